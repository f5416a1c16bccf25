"""Time to usable tensors: attach to the daemon versus an ordinary load, side by side.

For each shape (default: qwen2.5-0.5b and llama-8b demo checkpoints) a daemon process holds the
model; this process, playing the engine with its device context already up, times an ordinary
load from the page cache (read + process + place on the device) and repeated attaches (lease,
verify, open, rebuild, release). The first attach of the process receives and parses the full
manifest ("first"); later ones send the layout digest they hold and get only the lease and
handles ("p50", "p99"). A fresh process measures the cold attach separately ("cold": device
context already created there, its cost reported apart). CUDA when present, shared memory on a
CPU machine. Prints medians and the speedup of the first attach and of the median one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import CACHE, demo_checkpoint, median_seconds, save_json, warm_page_cache
from engine_client.attach import attach
from engine_client.checkpoint_read import read_checkpoint
from engine_client.client import ClientConfig
from engine_client.verify import Expectations
from harness.daemon_process import start_daemon
from harness.python_child import run_python
from harness.timing import percentile


def device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def expectations(path: Path) -> Expectations:
    return Expectations.for_checkpoint(path, device())


def cold_attach(url: str, model: str, path: Path) -> dict[str, float]:
    """Attach from a fresh process: device context and first kernel included."""
    code = f"""
import json, time
t0 = time.perf_counter()
import torch
from bench.attach import expectations, sync
from engine_client.attach import attach
from engine_client.client import ClientConfig
from pathlib import Path
from typing import Any
t1 = time.perf_counter()
if torch.cuda.is_available():
    torch.cuda.init(); torch.ones(1, device="cuda").add_(1); sync()
t2 = time.perf_counter()
with attach({model!r}, expectations(Path({str(path)!r})), config=ClientConfig(url={url!r}),
            keep_alive=False) as att:
    t3 = time.perf_counter()
    print(json.dumps({{"imports_ms": (t1 - t0) * 1e3, "context_ms": (t2 - t1) * 1e3,
                      "attach_ms": (t3 - t2) * 1e3}}))
"""
    out = run_python(code, timeout=600)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def bench_shape(
    shape: str, repeats: int, attaches: int, work: Path, handles: str = "fd"
) -> dict[str, Any]:
    path = demo_checkpoint(shape)
    size = warm_page_cache(path)
    dev = device()
    if dev.type == "cuda":
        torch.cuda.init()
        torch.ones(1, device=dev).add_(1)
        sync()
    daemon = start_daemon(
        work / shape,
        [path],
        "--model-id",
        shape,
        "--cuda-handles",
        handles,
        device="cuda:0" if dev.type == "cuda" else "cpu",
        timeout_s=1800,
    )
    try:
        config = ClientConfig(url=daemon.url)
        expect = expectations(path)

        def ordinary() -> None:
            tensors, _ = read_checkpoint(path, dev)
            sync()
            del tensors

        ordinary_s, _ = median_seconds(ordinary, repeats)
        times, parts = [], []
        for _ in range(attaches):
            start = time.perf_counter()
            att = attach(shape, expect, config=config, keep_alive=False)
            times.append(time.perf_counter() - start)
            parts.append(att.timings)
            zero_copy = att.zero_copy()
            nbytes = att.nbytes
            att.close()
        cold = cold_attach(daemon.url, shape, path)
    finally:
        daemon.stop()
    first = times[0]
    times.sort()
    p50 = statistics.median(times)
    return {
        "shape": shape,
        "device": str(dev),
        "cuda_handles": handles,
        "checkpoint_bytes": size,
        "leased_bytes": nbytes,
        "ordinary_load_ms": ordinary_s * 1e3,
        "first_attach_ms": first * 1e3,
        "attach_p50_ms": p50 * 1e3,
        "attach_p99_ms": percentile(times, 0.99) * 1e3,
        "lease_p50_ms": statistics.median(p.lease_ms for p in parts),
        "open_p50_ms": statistics.median(p.open_ms for p in parts),
        "rebuild_p50_ms": statistics.median(p.rebuild_ms for p in parts),
        "verify_p50_ms": statistics.median(p.verify_ms for p in parts),
        "cold_attach": cold,
        "zero_copy": zero_copy,
        "speedup": ordinary_s / p50,
        "speedup_first": ordinary_s / first,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", nargs="+", default=["qwen2.5-0.5b", "llama-8b"])
    parser.add_argument("--repeats", type=int, default=3, help="ordinary loads per shape")
    parser.add_argument("--attaches", type=int, default=20, help="attaches per shape")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--cuda-handles",
        nargs="+",
        default=["fd"],
        choices=["fd", "ipc"],
        help="how the daemon lends GPU arenas (both: side by side)",
    )
    args = parser.parse_args()
    work = CACHE / "attach-bench"
    work.mkdir(parents=True, exist_ok=True)
    results = [
        bench_shape(s, args.repeats, args.attaches, work, h)
        for s in args.shapes
        for h in args.cuda_handles
    ]
    print(
        f"{'shape':<14}{'handles':<8}{'device':<8}{'bytes':>12}{'ordinary ms':>12}{'first':>8}"
        f"{'p50':>7}{'p99':>7}{'lease':>7}{'open':>6}{'rebuild':>8}{'cold':>7}"
        f"{'speedup first/p50':>19}"
    )
    for r in results:
        print(
            f"{r['shape']:<14}{r['cuda_handles']:<8}{r['device']:<8}"
            f"{r['leased_bytes']:>12}"
            f"{r['ordinary_load_ms']:>12.1f}{r['first_attach_ms']:>8.2f}{r['attach_p50_ms']:>7.2f}"
            f"{r['attach_p99_ms']:>7.2f}{r['lease_p50_ms']:>7.2f}{r['open_p50_ms']:>6.2f}"
            f"{r['rebuild_p50_ms']:>8.2f}{r['cold_attach']['attach_ms']:>7.1f}"
            f"{r['speedup_first']:>10.0f}x /{r['speedup']:>6.0f}x"
        )
    save_json(args.json, results)


if __name__ == "__main__":
    main()
