"""``make demo``: a real vLLM 0.33 engine on this machine's CPU attached to the demo model, then
the same engine with vLLM's default loader; prints both token lists and both model loads.

It writes the demo checkpoint, starts ``weight-cache serve`` on it (CPU twin, a run directory
and arenas of its own, no keeper), runs :mod:`harness.cpu_engine` twice, each in a process of
its own whose output goes to a log, and stops the daemon. ``--url`` attaches through a daemon
already running instead (one that is down shows a fallback). If attaching fell back, the
loader's reason is the last line printed; if an engine failed, its error is."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from harness.cpu_engine import EngineResult
from harness.daemon_process import start_daemon
from service.demo import write_demo_checkpoint

LOADER_PREFIX = "weight-cache: "  # how the loader's own lines begin
TRACEBACK = "Traceback (most recent call last):"
RANK = re.compile(r"^\[rank\d+\]: ")


class EngineFailed(Exception):
    """An engine process ended without a result."""


def error_lines(log: str) -> list[str]:
    """The last exception a Python log shows: the lines after its last traceback's last frame
    (the exception itself and its notes), without the ``[rankN]:`` vLLM puts before a worker's
    lines; the log's last line if it shows no traceback."""
    lines = [RANK.sub("", line) for line in log.rstrip().splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith(TRACEBACK)]
    if not starts:
        return lines[-1:]
    after = lines[starts[-1] + 1 :]
    frames = [i for i, line in enumerate(after) if line.startswith(" ")]
    return after[frames[-1] + 1 :] if frames else after


def run_engine(checkpoint: Path, url: str | None, log: Path) -> EngineResult:
    """One engine (:mod:`harness.cpu_engine`) in its own process; its output goes to ``log``."""
    result = log.with_suffix(".json")
    args = [sys.executable, "-m", "harness.cpu_engine", str(checkpoint), str(result)]
    with log.open("wb") as out:
        done = subprocess.run(
            [*args, *(["--url", url] if url else [])], stdout=out, stderr=out, check=False
        )
    if done.returncode != 0 or not result.exists():
        shown = "\n".join(error_lines(log.read_text(errors="replace")))
        raise EngineFailed(
            f"the engine failed (exit {done.returncode}); its output: {log}\n{shown}"
        )
    return EngineResult.model_validate_json(result.read_text())


@contextmanager
def demo_daemon(work: Path, checkpoint: Path, url: str | None) -> Iterator[str]:
    """The daemon's URL: ``url`` as given, else that of a daemon started here on ``checkpoint``
    and stopped on leaving."""
    if url:
        yield url
        return
    daemon = start_daemon(work, [checkpoint], device="cpu", timeout_s=120)
    print(f"weight-cache serve: {daemon.url} (log {daemon.log})")
    try:
        yield daemon.url
    finally:
        daemon.stop()


def report(attached: EngineResult, default: EngineResult, work: Path) -> list[str]:
    """What the demo prints at its end; a fallback's reason last."""
    lines = [
        f"weight_cache tokens: {attached.tokens}",
        f"default tokens:      {default.tokens}",
        f"tokens equal: {attached.tokens == default.tokens}",
        f"weight_cache: Model loading took {attached.loading_s:.6f} seconds",
        f"default:      Model loading took {default.loading_s:.6f} seconds",
        f"engine logs: {work}",
    ]
    said = attached.fallback or attached.attached or "the loader said neither attached nor why not"
    return [*lines, f"weight_cache engine: {said.removeprefix(LOADER_PREFIX)}"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.engine_demo", description=__doc__)
    parser.add_argument("--url", help="attach through this daemon instead of starting one")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="weight-cache-demo-"))
    checkpoint = work / "demo"
    write_demo_checkpoint(checkpoint, "fp8", "tiny")
    print(f"demo checkpoint: {checkpoint}")
    try:
        with demo_daemon(work, checkpoint, args.url) as url:
            print("vLLM 0.33 on the CPU, --load-format weight_cache ...", flush=True)
            attached = run_engine(checkpoint, url, work / "engine-weight-cache.log")
        print("vLLM 0.33 on the CPU, vLLM's default loader ...", flush=True)
        default = run_engine(checkpoint, None, work / "engine-default.log")
    except EngineFailed as failed:
        print(failed, flush=True)
        sys.exit(1)
    print("\n".join(report(attached, default, work)))


if __name__ == "__main__":
    main()
