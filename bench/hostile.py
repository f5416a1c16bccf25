"""``/health`` while the daemon is attacked: one row per hostile case, with what was tried,
what held, and ``/health`` p50/p99/max sampled every 10 ms on a connection opened beforehand.

A daemon process serves the qwen2.5-0.5b demo model with its default limits (256 connections,
32 KiB of headers, 10 s to send a request, 4096 leases, 256 per client) and one allowed root.
Each case is bounded in count and time and talks to 127.0.0.1 only. Target: ``/health`` p99 at
most 50 ms during every case on a 2-core machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.common import CACHE, demo_checkpoint
from modelopt_fp8.checkpoint import checkpoint_fingerprint
from tests.checkpoint_tools import rewrite_header
from tests.daemon_process import DaemonProcess, lease_body, start_daemon
from tests.hostile.probe import HealthProbe

Case = Callable[[DaemonProcess, Path], tuple[int, int, str]]  # -> tried, held, what held


def _probe_main(url: str, stop: Any, out: Any) -> None:
    with HealthProbe(url, min_samples=20) as probe:
        out.put("connected")
        stop.wait(3600)
    out.put((probe.samples, probe.failures))


class ProbeProcess:
    """A :class:`HealthProbe` in a process of its own, so the attacking code in this process
    (threads swapping files, sockets by the thousand) does not slow the probe's own client."""

    def __init__(self, url: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._out = ctx.Queue()
        self._proc = ctx.Process(target=_probe_main, args=(url, self._stop, self._out))
        self.probe = HealthProbe(url)

    def __enter__(self) -> HealthProbe:
        self._proc.start()
        assert self._out.get(timeout=120) == "connected"  # before the case starts
        return self.probe

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.probe.samples, self.probe.failures = self._out.get(timeout=120)
        self._proc.join(30)


def _sock(daemon: DaemonProcess) -> socket.socket:
    port = int(daemon.url.rsplit(":", 1)[1])
    return socket.create_connection(("127.0.0.1", port), timeout=30)


def _status(s: socket.socket) -> int:
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except OSError:
        pass
    try:
        return int(data.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0


def _checkpoint(work: Path, src: Path, name: str) -> Path:
    path = work / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir()
    for f in src.iterdir():
        os.link(f, path / f.name)  # hard links: a broken copy costs no disk
    return path


def idle(daemon: DaemonProcess, work: Path) -> tuple[int, int, str]:
    time.sleep(2)
    return 0, 0, "baseline"


def fifo(daemon: DaemonProcess, work: Path) -> tuple[int, int, str]:
    src = Path(daemon.models[0])  # type: ignore[attr-defined]
    path = _checkpoint(work, src, "fifo")
    (path / "model.safetensors").unlink()
    os.mkfifo(path / "model.safetensors")
    held = 0
    for i in range(20):
        r = httpx.post(f"{daemon.url}/v1/models", json={"path": str(path), "id": f"f{i}"})
        held += r.status_code == 422 and r.json()["code"] == "not_regular_file"
    return 20, held, "422 not_regular_file at once"


def _big_header(daemon: DaemonProcess) -> int:
    s = _sock(daemon)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
    try:
        for _ in range(100 * 16):  # 100 MB in 64 KiB writes
            s.sendall(b"a" * 65536)
    except OSError:
        pass
    status = _status(s)
    s.close()
    return status


def one_header(daemon: DaemonProcess, work: Path) -> tuple[int, int, str]:
    return 1, int(_big_header(daemon) == 431), "431 headers_too_large"


def four_headers(daemon: DaemonProcess, work: Path) -> tuple[int, int, str]:
    out: list[int] = []
    threads = [threading.Thread(target=lambda: out.append(_big_header(daemon))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return 4, out.count(431), "431 headers_too_large"


def slowloris(daemon: DaemonProcess, work: Path) -> tuple[int, int, str]:
    socks = [_sock(daemon) for _ in range(200)]
    for s in socks:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    statuses = [_status(s) for s in socks]  # each closed by the 10 s request deadline
    for s in socks:
        s.close()
    return 200, statuses.count(408), "408 request_timeout"


def connection_flood(daemon: DaemonProcess, work: Path) -> tuple[int, int, str]:
    refused = tried = 0
    for _ in range(10):
        socks = [_sock(daemon) for _ in range(500)]
        tried += len(socks)
        for s in socks:
            s.sendall(b"GET /he")  # half a request, never finished
        time.sleep(0.2)
        for s in socks[256:]:
            s.settimeout(5)
            refused += _status(s) == 503
        for s in socks:
            s.close()
    return tried, refused, "503 too_many_connections beyond the 256 held"


def many_files(daemon: DaemonProcess, work: Path) -> tuple[int, int, str]:
    path = work / "crowded-txt"
    if not path.is_dir():
        path.mkdir()
        for i in range(100_000):
            (path / f"{i}.txt").touch()
    r = httpx.post(f"{daemon.url}/v1/models", json={"path": str(path), "id": "crowded"}, timeout=60)
    r.raise_for_status()
    while (info := httpx.get(f"{daemon.url}/v1/models/crowded").json())["state"] == "loading":
        time.sleep(0.01)
    httpx.delete(f"{daemon.url}/v1/models/crowded")
    held = info["error"]["code"] == "checkpoint_not_found"
    return 1, int(held), "listed off the loop; checkpoint_not_found"


def lying_config(daemon: DaemonProcess, work: Path) -> tuple[int, int, str]:
    src = Path(daemon.models[0])  # type: ignore[attr-defined]
    path = _checkpoint(work, src, "liar")
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = 1_000_000
    (path / "config.json").unlink()
    (path / "config.json").write_text(json.dumps(config))
    start = time.perf_counter()
    httpx.post(f"{daemon.url}/v1/models", json={"path": str(path), "id": "liar"}).raise_for_status()
    while (info := httpx.get(f"{daemon.url}/v1/models/liar").json())["state"] == "loading":
        time.sleep(0.005)
    took = time.perf_counter() - start
    httpx.delete(f"{daemon.url}/v1/models/liar")
    held = info["error"]["code"] == "invalid_config"
    return 1, int(held), f"invalid_config in {took * 1e3:.0f} ms"


def deep_config(daemon: DaemonProcess, work: Path) -> tuple[int, int, str]:
    src = Path(daemon.models[0])  # type: ignore[attr-defined]
    path = _checkpoint(work, src, "deep")
    (path / "config.json").unlink()
    (path / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    httpx.post(f"{daemon.url}/v1/models", json={"path": str(path), "id": "deep"}).raise_for_status()
    while (info := httpx.get(f"{daemon.url}/v1/models/deep").json())["state"] == "loading":
        time.sleep(0.005)
    httpx.delete(f"{daemon.url}/v1/models/deep")
    return 1, int(info["error"]["code"] == "invalid_config"), "invalid_config"


def _swap_files(weights: Path, good: Path, target: Path, stop: Any) -> None:
    """The attacker: swap ``weights`` between a hard link of the inside file and a symlink to
    the outside one, as fast as it can, until ``stop`` is set."""
    link = weights.with_name("swap.tmp")
    for i in range(100_000_000):
        if i % 256 == 0 and stop.is_set():
            return
        link.unlink(missing_ok=True)
        link.symlink_to(target) if i % 2 else os.link(good, link)
        os.replace(link, weights)


def symlink_race(daemon: DaemonProcess, work: Path) -> tuple[int, int, str]:
    """40 loads of a checkpoint whose weights an attacking process (a core of its own) keeps
    swapping for a symlink out of the root; the loads are driven over one kept-alive client."""
    src = Path(daemon.models[0])  # type: ignore[attr-defined]
    inside = _checkpoint(work, src, "race")
    weights = inside / "model.safetensors"
    good = inside / "good.bin"
    os.link(weights, good)
    expected = checkpoint_fingerprint(inside).digest
    outside = work.parent / "outside-of-root"
    outside.mkdir(exist_ok=True)
    target = outside / "model.safetensors"
    shutil.copyfile(weights, target)
    rewrite_header(target, lambda h: h.update({"__metadata__": {"origin": "outside"}}))
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    attacker = ctx.Process(target=_swap_files, args=(weights, good, target, stop), daemon=True)
    attacker.start()
    held = 0
    outcomes: dict[str, int] = {}
    try:
        with httpx.Client(base_url=daemon.url, timeout=60) as client:
            for i in range(40):
                r = client.post("/v1/models", json={"path": str(inside), "id": f"r{i}"})
                if r.status_code != 202:
                    outcome = f"refused {r.json()['code']}"
                    held += r.json()["code"] == "path_not_allowed"
                else:
                    while (info := client.get(f"/v1/models/r{i}").json())["state"] == "loading":
                        time.sleep(0.01)
                    ok = info["state"] == "failed" and info["error"]["code"] == "path_not_allowed"
                    inside_file = info.get("fingerprint") == expected
                    held += ok or inside_file
                    outcome = (
                        f"failed {info['error']['code']}"
                        if info["state"] == "failed"
                        else ("loaded the inside file" if inside_file else "loaded ANOTHER file")
                    )
                    client.delete(f"/v1/models/r{i}")
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
    finally:
        stop.set()
        attacker.join(10)
        if attacker.is_alive():
            attacker.kill()
    how = ", ".join(f"{n} {what}" for what, n in sorted(outcomes.items()))
    return 40, held, f"refused or loaded the inside file, never the outside one ({how})"


def leases_capped(daemon: DaemonProcess, work: Path) -> tuple[int, int, str]:
    """20,000 lease requests of one client against the default caps."""
    codes: dict[int, int] = {}
    granted = []
    with httpx.Client(base_url=daemon.url, timeout=60) as client:
        for _ in range(20_000):
            r = client.post("/v1/leases", json=lease_body("qwen", ttl_s=900))
            codes[r.status_code] = codes.get(r.status_code, 0) + 1
            if r.status_code == 201:
                granted.append(r.json()["lease"]["id"])
            elif r.json()["code"] != "too_many_client_leases":
                break
        for lease in granted:
            client.delete(f"/v1/leases/{lease}")
    return 20_000, codes.get(429, 0), f"{codes.get(201, 0)} granted, the rest 429"


def leases_20k(daemon: DaemonProcess, work: Path) -> tuple[int, int, str]:
    """20,000 leases held at once (caps raised), swept every second, reaped when the client
    dies (the finding: /proc reads on the loop pushed /health p90 to 717 ms)."""
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(900)"])

    async def grant() -> int:
        async with httpx.AsyncClient(base_url=daemon.url, timeout=60) as client:
            sem = asyncio.Semaphore(16)

            async def one() -> bool:
                async with sem:
                    r = await client.post(
                        "/v1/leases", json=lease_body("qwen", client_pid=holder.pid, ttl_s=900)
                    )
                    return r.status_code == 201

            return sum(await asyncio.gather(*(one() for _ in range(20_000))))

    try:
        granted = asyncio.run(grant())
        time.sleep(3)  # the reaper sweeps them every second
        holder.kill()
        holder.wait()
        deadline = time.monotonic() + 30

        def active() -> int:  # the count, not the list: listing 20,000 leases is O(n)
            return int(httpx.get(f"{daemon.url}/v1/inventory").json()["active_leases"])

        while active() and time.monotonic() < deadline:
            time.sleep(0.1)
        left = active()
    finally:
        if holder.poll() is None:
            holder.kill()
    return 20_000, granted if left == 0 else 0, "granted, swept, reaped when the client died"


CASES: dict[str, Case] = {
    "idle": idle,
    "FIFO as model.safetensors": fifo,
    "one 100 MB header": one_header,
    "four 100 MB headers": four_headers,
    "200 half-sent requests": slowloris,
    "5,000 connections": connection_flood,
    "100,000-file directory": many_files,
    "num_hidden_layers 1,000,000": lying_config,
    "config.json 100,000 deep": deep_config,
    "symlink swap race": symlink_race,
    "20,000 leases, default caps": leases_capped,
}


def leases_case(model: Path, work: Path) -> dict[str, Any]:
    daemon = start_daemon(
        work / "leases",
        [model],
        "--model-id",
        "qwen",
        "--max-leases",
        "30000",
        "--max-leases-per-client",
        "30000",
        "--max-leases-per-uid",
        "30000",
        timeout_s=600,
    )
    try:
        with ProbeProcess(daemon.url) as probe:
            tried, held, what = leases_20k(daemon, work)
    finally:
        daemon.stop()
    return _row("20,000 leases + reaper", probe, tried, held, what)


def scrub_case(model: Path, work: Path) -> dict[str, Any]:
    """A daemon scrubbing the qwen arena (~0.6 GB) every second, /health polled for 6 s."""
    daemon = start_daemon(
        work / "scrub", [model], "--model-id", "qwen", "--scrub-interval", "1", timeout_s=600
    )
    try:
        with ProbeProcess(daemon.url) as probe:
            time.sleep(6)
        scrubs = [
            line
            for line in httpx.get(f"{daemon.url}/metrics").text.splitlines()
            if line.startswith("weight_cache_scrubs_total")
        ]
    finally:
        daemon.stop()
    return _row("scrub every 1 s (qwen arena)", probe, 1, 1, scrubs[0] if scrubs else "")


def _row(name: str, probe: HealthProbe, tried: int, held: int, what: str) -> dict[str, Any]:
    return {
        "case": name,
        "tried": tried,
        "held": held,
        "what": what,
        "health_n": len(probe.samples),
        "health_failures": len(probe.failures),
        "failures": sorted(set(probe.failures))[:3],
        "p50_ms": probe.p50 * 1e3,
        "p99_ms": probe.p99 * 1e3,
        "max_ms": probe.max * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", nargs="*", help="case names to run (default: all)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    model = demo_checkpoint("qwen2.5-0.5b")
    work = CACHE / "hostile-bench"
    allowed = work / "allowed"
    allowed.mkdir(parents=True, exist_ok=True)
    daemon = start_daemon(
        work, [model], "--model-id", "qwen", "--allowed-root", str(allowed), timeout_s=600
    )
    daemon.models = [str(model)]  # type: ignore[attr-defined]
    rows = []
    try:
        for name, case in CASES.items():
            if args.only and name not in args.only:
                continue
            with ProbeProcess(daemon.url) as probe:
                tried, held, what = case(daemon, allowed)
            rows.append(_row(name, probe, tried, held, what))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        daemon.stop()
    if not args.only or "leases" in args.only:
        rows.append(leases_case(model, work))
        print(json.dumps(rows[-1]), flush=True)
    if not args.only or "scrub" in args.only:
        rows.append(scrub_case(model, work))
    print(f"\n{'case':<30}{'tried':>7}{'held':>7}{'n':>6}{'p50 ms':>8}{'p99 ms':>8}{'max ms':>8}")
    for r in rows:
        print(
            f"{r['case']:<30}{r['tried']:>7}{r['held']:>7}{r['health_n']:>6}"
            f"{r['p50_ms']:>8.1f}{r['p99_ms']:>8.1f}{r['max_ms']:>8.1f}"
            + (f"  {r['health_failures']} /health failures" if r["health_failures"] else "")
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
