"""What the benchmarks share: cached demo checkpoints and a repeat-and-take-the-median timer."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from protocol.client_settings import BenchSettings
from service.demo import write_demo_checkpoint

T = TypeVar("T")

CACHE = BenchSettings().bench_dir


def demo_checkpoint(shape: str, scheme: str = "fp8") -> Path:
    """The demo checkpoint for ``shape``, generated once into the cache directory."""
    path = CACHE / f"{shape}-{scheme}"
    if not (path / "config.json").is_file():
        print(f"generating the {shape} {scheme} demo checkpoint in {path} ...", flush=True)
        write_demo_checkpoint(path, scheme, shape)
    return path


def shm_scratch() -> Path:
    """A private directory for arenas, in shared memory where there is /dev/shm (as the daemon's
    default); the caller removes it."""
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return Path(tempfile.mkdtemp(prefix="weight-cache-bench-", dir=root))


def warm_page_cache(path: Path) -> int:
    """Read every file once so timings measure the page cache, not the disk; returns bytes."""
    total = 0
    for f in sorted(path.iterdir()):
        with f.open("rb") as fh:
            while chunk := fh.read(64 << 20):
                total += len(chunk)
    return total


def save_json(path: Path | None, figures: object) -> None:
    """Write the run's figures to ``path`` (a benchmark's ``--json``), if one was given."""
    if path is not None:
        path.write_text(json.dumps(figures, indent=2))


def median_seconds(
    fn: Callable[[], T], repeats: int, dispose: Callable[[T], object] | None = None
) -> tuple[float, list[float]]:
    """Median wall time of ``fn`` over ``repeats`` calls. What it returns is kept until the
    clock stops, then handed to ``dispose`` (freeing gigabytes is not part of making them)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
        if dispose is not None:
            dispose(out)
        del out
    return statistics.median(times), times
