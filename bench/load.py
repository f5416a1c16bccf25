"""Sustained load: leases per second and p99 latency at 64 concurrent clients for 60 seconds,
with the error count (target: zero errors).

A daemon process holds the qwen2.5-0.5b demo model; 64 clients (asyncio tasks, 8 to a client
process) lease and release in a loop for the whole period.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from bench.common import CACHE, demo_checkpoint, save_json
from bench.lease import concurrent_round_trips
from harness.daemon_process import start_daemon
from harness.timing import percentile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--per-process", type=int, default=8)
    parser.add_argument("--cold", action="store_true", help="full manifest in every grant")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    path = demo_checkpoint("qwen2.5-0.5b")
    work = CACHE / "load-bench"
    work.mkdir(parents=True, exist_ok=True)
    daemon = start_daemon(work, [path], "--model-id", "qwen", timeout_s=600)
    try:
        samples, errors = concurrent_round_trips(
            daemon.url, "qwen", args.clients, args.seconds, not args.cold, args.per_process
        )
        alive = daemon.process.poll() is None
    finally:
        daemon.stop()
    result = {
        "clients": args.clients,
        "seconds": args.seconds,
        "leases": len(samples),
        "leases_per_second": len(samples) / args.seconds,
        "errors": errors,
        "p50_ms": statistics.median(samples) * 1e3,
        "p99_ms": percentile(samples, 0.99) * 1e3,
        "layout": "cold" if args.cold else "warm",
        "daemon_alive": alive,
    }
    print(
        f"{args.clients} clients for {args.seconds:.0f} s ({result['layout']} layouts): "
        f"{result['leases_per_second']:.0f} leases/s, p50 {result['p50_ms']:.1f} ms, "
        f"p99 {result['p99_ms']:.1f} ms, errors {errors} (target 0), daemon alive {alive}"
    )
    save_json(args.json, result)


if __name__ == "__main__":
    main()
