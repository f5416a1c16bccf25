"""Hostile lease clients: floods against the caps, PIDs the daemon cannot see, a neighbour
leasing in a victim's process, another user's leases, thousands of leases of a dying client."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.hostile_tools import Result, Target, as_user
from harness.daemon_process import lease_body
from harness.hostile.users import NOBODY


def leases_capped(target: Target, work: Path) -> Result:
    """20,000 lease requests of one client against the default caps."""
    codes: dict[int, int] = {}
    granted = []
    with httpx.Client(base_url=target.url, timeout=60) as client:
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


def invisible_pids(target: Target, work: Path) -> Result:
    """4,096 leases for PIDs of no process (they were accepted unwatched, never reaped, and
    filled the table in 4 s)."""
    refused = 0
    granted = []
    with httpx.Client(base_url=target.url, timeout=60) as client:
        for i in range(4096):
            r = client.post("/v1/leases", json=lease_body("qwen", client_pid=4_000_000 + i))
            if r.status_code == 201:
                granted.append(r.json()["lease"]["id"])
            else:
                refused += r.json()["code"] == "client_not_visible"
        for lease in granted:
            client.delete(f"/v1/leases/{lease}")
    return 4096, refused, f"refused client_not_visible ({len(granted)} granted)"


def foreign_lease(target: Target, work: Path) -> Result:
    """Another user (uid 65534) lists the leases and tries to end and renew one of the
    daemon's user (any client could)."""
    if os.geteuid() != 0:
        return 0, 0, "skipped: needs root to act as another user"
    with httpx.Client(base_url=target.url, timeout=60) as client:
        lease = client.post("/v1/leases", json=lease_body("qwen")).json()["lease"]["id"]
        seen = as_user(NOBODY, target.url, lease)
        alive = client.get(f"/v1/leases/{lease}").status_code == 200
        client.delete(f"/v1/leases/{lease}")
    tried = seen["tried"]
    assert isinstance(tried, list) and isinstance(seen["listed"], list)
    held = int(lease not in seen["listed"]) + sum(s >= 400 for s in tried)
    return 3, held if alive else 0, f"list, DELETE, renew answered {tried}; lease kept: {alive}"


def leases_20k(target: Target, work: Path) -> Result:
    """20,000 leases held at once (caps raised), swept every second, reaped when the client
    dies."""
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(900)"])

    async def grant() -> int:
        async with httpx.AsyncClient(base_url=target.url, timeout=60) as client:
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
            return int(httpx.get(f"{target.url}/v1/inventory").json()["active_leases"])

        while active() and time.monotonic() < deadline:
            time.sleep(0.1)
        left = active()
    finally:
        if holder.poll() is None:
            holder.kill()
    return 20_000, granted if left == 0 else 0, "granted, swept, reaped when the client died"
