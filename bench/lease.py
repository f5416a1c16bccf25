"""Lease round trips under concurrency, and ``/health`` while a large model loads.

1. A daemon process holds the qwen2.5-0.5b demo model. 1, 8 and 32 concurrent clients (asyncio
   tasks, at most 8 to a client process, as engines are separate processes) each lease (request
   sent to manifest parsed into the pydantic model) and release in a loop; p50/p99 of the lease
   round trip per concurrency. "cold": every grant carries and parses the full manifest
   (~120 KB), as an engine's first lease does; "warm": the client holds the layout and the grant
   carries only the lease and handles.
2. The same daemon starts loading the llama-8b demo model over the API; a client polls
   ``/health`` throughout the load while another leases and releases the ready qwen model in a
   loop; ``/health`` p50/p99, the leases granted meanwhile (p50/p99, errors) and the load's
   duration.

Targets: lease p99 under 20 ms at 32 clients; ``/health`` p99 under 10 ms during the load.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import CACHE, demo_checkpoint, save_json, shm_scratch
from engine_client.client import AsyncDaemonClient, ClientConfig
from harness.daemon_process import start_daemon
from harness.timing import percentile
from modelopt_fp8.schemes import demo_schemes
from protocol.errors import WeightCacheError


async def lease_round_trips(
    url: str, model: str, clients: int, seconds: float, cached: bool
) -> tuple[list[float], int]:
    """Lease-and-release loops; returns lease round-trip times and the number of errors."""
    config = ClientConfig(url=url, cache_layouts=cached)
    samples: list[float] = []
    errors = 0
    deadline = time.perf_counter() + seconds

    async def one(client: AsyncDaemonClient) -> None:
        nonlocal errors
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            try:
                grant = await client.lease(model, ttl_s=30)
                samples.append(time.perf_counter() - start)
                await client.release(grant.lease.id)
            except WeightCacheError:
                errors += 1

    async with AsyncDaemonClient(config) as client:
        await client.lease(model, ttl_s=5)  # warm the connection pool and the daemon
        await asyncio.gather(*(one(client) for _ in range(clients)))
    return samples, errors


async def health_during_load(url: str, path: Path, interval: float) -> dict[str, Any]:
    """Load ``path`` as model ``big`` over the API; meanwhile poll ``/health`` every
    ``interval`` seconds and lease (and release) the ready model ``qwen`` in a loop."""
    health: list[float] = []
    leases: list[float] = []
    errors = 0
    loading = True

    async def lease_loop() -> None:
        nonlocal errors
        async with AsyncDaemonClient(ClientConfig(url=url)) as client:
            await client.release((await client.lease("qwen", ttl_s=30)).lease.id)  # layout held
            while loading:
                start = time.perf_counter()
                try:
                    grant = await client.lease("qwen", ttl_s=30)
                    leases.append(time.perf_counter() - start)
                    await client.release(grant.lease.id)
                except WeightCacheError:
                    errors += 1

    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        leaser = asyncio.create_task(lease_loop())
        await asyncio.sleep(0.5)  # leases flowing before the load starts
        start = time.perf_counter()
        r = await http.post("/v1/models", json={"path": str(path), "id": "big"})
        r.raise_for_status()
        while True:
            t0 = time.perf_counter()
            (await http.get("/health")).raise_for_status()
            health.append(time.perf_counter() - t0)
            info = (await http.get("/v1/models/big")).json()
            if info["state"] != "loading":
                break
            await asyncio.sleep(interval)
        wall_s = time.perf_counter() - start
        loading = False
        await leaser
    return {
        "state": info["state"],
        "load_s": info.get("load_seconds") or wall_s,
        "samples": len(health),
        "p50_ms": statistics.median(health) * 1e3,
        "p99_ms": percentile(health, 0.99) * 1e3,
        "max_ms": max(health) * 1e3,
        "leases": len(leases),
        "lease_errors": errors,
        "lease_p50_ms": statistics.median(leases) * 1e3 if leases else None,
        "lease_p99_ms": percentile(leases, 0.99) * 1e3 if leases else None,
    }


def _client_process(
    url: str, model: str, clients: int, seconds: float, cached: bool, queue: Any
) -> None:
    queue.put(asyncio.run(lease_round_trips(url, model, clients, seconds, cached)))


def concurrent_round_trips(
    url: str, model: str, clients: int, seconds: float, cached: bool, per_process: int
) -> tuple[list[float], int]:
    """``clients`` concurrent lease loops spread over processes of ``per_process`` each."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    shares = [min(per_process, clients - i) for i in range(0, clients, per_process)]
    procs = [
        ctx.Process(target=_client_process, args=(url, model, n, seconds, cached, queue))
        for n in shares
    ]
    for proc in procs:
        proc.start()
    samples: list[float] = []
    errors = 0
    for _ in procs:
        got, failed = queue.get(timeout=seconds + 120)
        samples.extend(got)
        errors += failed
    for proc in procs:
        proc.join()
    return samples, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=10.0, help="per concurrency level")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--per-process", type=int, default=8, help="clients per client process")
    parser.add_argument(
        "--load-shape", default="llama-8b", help="model loaded while /health is polled ('' to skip)"
    )
    parser.add_argument("--load-scheme", default="fp8", choices=sorted(demo_schemes()))
    parser.add_argument("--device", default="cpu", help="the daemon's --device")
    parser.add_argument("--only-load", action="store_true", help="skip the lease round trips")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    small = demo_checkpoint("qwen2.5-0.5b")
    big = demo_checkpoint(args.load_shape, args.load_scheme) if args.load_shape else None
    work = CACHE / "lease-bench"
    work.mkdir(parents=True, exist_ok=True)
    roots = ["--allowed-root", str(CACHE)]
    shm = shm_scratch()
    daemon = start_daemon(
        work, [small], "--model-id", "qwen", *roots, shm_dir=shm, timeout_s=600, device=args.device
    )
    results: dict[str, Any] = {"lease": [], "health_during_load": None}
    try:
        levels = [] if args.only_load else args.clients
        for cached, clients in [(c, n) for c in (False, True) for n in levels]:
            samples, errors = concurrent_round_trips(
                daemon.url, "qwen", clients, args.seconds, cached, args.per_process
            )
            results["lease"].append(
                {
                    "layout": "warm" if cached else "cold",
                    "clients": clients,
                    "errors": errors,
                    "leases": len(samples),
                    "per_second": len(samples) / args.seconds,
                    "p50_ms": statistics.median(samples) * 1e3,
                    "p99_ms": percentile(samples, 0.99) * 1e3,
                }
            )
        if big is not None:
            results["health_during_load"] = asyncio.run(health_during_load(daemon.url, big, 0.005))
    finally:
        daemon.stop()
        shutil.rmtree(shm, ignore_errors=True)
    print("lease round trip (qwen2.5-0.5b manifest, request to parsed), shared memory arena")
    print(f"{'layout':>7}{'clients':>8}{'leases/s':>10}{'p50 ms':>9}{'p99 ms':>9}  (p99 < 20 ms)")
    for r in results["lease"]:
        print(
            f"{r['layout']:>7}{r['clients']:>8}{r['per_second']:>10.0f}{r['p50_ms']:>9.2f}"
            f"{r['p99_ms']:>9.2f}"
        )
    h = results["health_during_load"]
    if h:
        print(
            f"/health during a {args.load_shape} {args.load_scheme} load ({h['load_s']:.1f} s, "
            f"{h['samples']} "
            f"requests): p50 {h['p50_ms']:.2f} ms, p99 {h['p99_ms']:.2f} ms, max "
            f"{h['max_ms']:.2f} ms   target p99 < 10 ms"
        )
        print(
            f"leases of the ready qwen model meanwhile: {h['leases']} granted, "
            f"{h['lease_errors']} errors, p50 {h['lease_p50_ms'] or 0:.2f} ms, "
            f"p99 {h['lease_p99_ms'] or 0:.2f} ms"
        )
    save_json(args.json, results)


if __name__ == "__main__":
    main()
