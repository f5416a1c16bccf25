"""A restart of the daemon under a keeper: how soon a new daemon process has every model ready
again (no checkpoint read), and the daemon's footprint before and after.

A daemon process (``--keeper auto``) loads the demo checkpoint of ``--shape``; it is killed with
SIGKILL and started again on the same run directory. Printed: the footprint (the inventory's
``process_memory``, NVML's per-process figure on a GPU) against ``cache_bytes``, the new
daemon's own adoption time (its log line: keeper snapshot, mapping, checksum check), and the
time from starting the new process to ``/ready`` (Python imports and the CUDA context included).

    python -m bench.restart --shape llama-8b --device cuda:0
"""

from __future__ import annotations

import argparse
import re
import signal
import time
from typing import Any

import httpx

from bench.common import CACHE, demo_checkpoint
from harness.daemon_process import free_port, start_daemon, stop_keeper


def footprint(url: str) -> dict[str, Any]:
    inventory = httpx.get(f"{url}/v1/inventory", timeout=30).json()
    device = inventory["devices"][0]
    return {
        "cache_bytes": inventory["cache_bytes"],
        "process_memory": device["process_memory"],
        "source": device["process_memory_source"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="llama-8b")
    parser.add_argument("--device", default="cuda:0")
    args = parser.parse_args()
    path = demo_checkpoint(args.shape)
    work = CACHE / "restart-bench"
    work.mkdir(parents=True, exist_ok=True)
    port, run = free_port(), work / f"run-{time.monotonic_ns()}"
    common: dict[str, Any] = {
        "port": port,
        "device": args.device,
        "run_dir": run,
        "keeper": "auto",
        "timeout_s": 1800,
    }
    first = start_daemon(work, [path], "--model-id", args.shape, **common)
    second = None
    try:
        before = footprint(first.url)
        first.stop(signal.SIGKILL)
        start = time.monotonic()
        second = start_daemon(work, [path], "--model-id", args.shape, **common)
        ready_s = time.monotonic() - start
        log = second.log.read_text()
        took = re.search(r"took over (\d+) of (\d+) model\(s\).* in ([0-9.]+) s", log)
        after = footprint(second.url)
    finally:
        first.stop(signal.SIGKILL)
        if second is not None:
            second.stop()
        stop_keeper(run)
    gib = 1 << 30
    print(f"shape {args.shape} on {args.device}")
    for label, f in (("first daemon", before), ("after adoption", after)):
        used = f["process_memory"]
        print(
            f"  {label}: cache {f['cache_bytes'] / gib:.2f} GiB, process "
            f"{'?' if used is None else f'{used / gib:.2f} GiB'} ({f['source']})"
        )
    if took is None:
        print("  no adoption line in the new daemon's log:\n" + log[-3000:])
        return
    print(
        f"  adopted {took.group(1)} of {took.group(2)} model(s) in {float(took.group(3)):.3f} s "
        f"(the daemon's own figure); process start to /ready {ready_s:.2f} s"
    )


if __name__ == "__main__":
    main()
