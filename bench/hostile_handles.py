"""Hostile peers of the handle socket: a member of its group trickling bytes into many
connections while the rightful lease holder asks for its descriptor."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.hostile_tools import Result, Target
from protocol.errors import WeightCacheError
from protocol.handle_socket import fetch_arena_fd
from protocol.schemas.leases import LeaseGrant
from protocol.schemas.manifest import ShmHandle
from tests.daemon_process import lease_body
from tests.hostile.users import NOBODY, run_attacker


def trickled(target: Target, work: Path) -> Result:
    """70 connections of a member of the socket's group each send one byte every 4 s, made
    again when closed, for 20 s (the probe's kept the holder out, ECONNRESET, for 40 s); the
    lease's holder asks for its descriptor every 0.2 s meanwhile: held counts the answers."""
    r = httpx.post(f"{target.url}/v1/leases", json=lease_body("qwen", ttl_s=600), timeout=30)
    grant = LeaseGrant.model_validate_json(r.content)
    handle = grant.arenas[0].handle
    assert isinstance(handle, ShmHandle) and handle.access is not None
    access = handle.access
    seen: dict[str, Any] = {}

    def attack() -> None:
        seen.update(
            run_attacker(
                NOBODY, "trickle", path=access.socket, connections=70, seconds=20.0, every_s=4.0
            )
        )

    attacker = threading.Thread(target=attack)
    attacker.start()
    time.sleep(1.0)  # its connections are open before the holder asks
    asked = answered = 0
    slowest = 0.0
    errors: set[str] = set()
    while attacker.is_alive():
        asked += 1
        start = time.perf_counter()
        try:
            fd, _ = fetch_arena_fd(access, grant.lease.id, 0, timeout_s=10)
        except (WeightCacheError, OSError) as exc:
            errors.add(str(exc)[:100])
        else:
            os.close(fd)
            answered += 1
            slowest = max(slowest, time.perf_counter() - start)
        time.sleep(0.2)
    attacker.join()
    httpx.delete(f"{target.url}/v1/leases/{grant.lease.id}")
    how = f"answered, slowest {slowest * 1e3:.0f} ms; attacker {seen}" + (
        f"; errors {sorted(errors)[:2]}" if errors else ""
    )
    return asked, answered, how
