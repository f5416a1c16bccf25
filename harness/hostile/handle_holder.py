"""A lease holder asking the handle socket for its descriptor, again and again, while a member
of the socket's group trickles bytes into many connections: for the hostile tests and
``bench.hostile``."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from harness.daemon_process import lease_body
from harness.hostile.users import NOBODY, run_attacker
from protocol.errors import WeightCacheError
from protocol.handle_socket import fetch_arena_fd
from protocol.schemas.leases import LeaseGrant
from protocol.schemas.manifest import ShmHandle


@dataclass
class Outcome:
    asked: int = 0
    answered: int = 0
    slowest_s: float = 0.0
    errors: set[str] = field(default_factory=set)
    attacker: dict[str, Any] = field(default_factory=dict)  # what the trickler saw


def holder_under_trickle(
    url: str, model: str, connections: int, seconds: float, every_s: float
) -> Outcome:
    """This process leases ``model`` and asks for its arena's descriptor every 0.1 s while
    ``connections`` connections of nobody (the daemon's ``--shm-group``) trickle a byte every
    ``every_s`` for ``seconds``."""
    r = httpx.post(f"{url}/v1/leases", json=lease_body(model, ttl_s=600), timeout=30)
    grant = LeaseGrant.model_validate_json(r.content)
    handle = grant.arenas[0].handle
    assert isinstance(handle, ShmHandle) and handle.access is not None
    access = handle.access
    outcome = Outcome()

    def attack() -> None:
        outcome.attacker = run_attacker(
            NOBODY,
            "trickle",
            path=access.socket,
            connections=connections,
            seconds=seconds,
            every_s=every_s,
        )

    attacker = threading.Thread(target=attack)
    attacker.start()
    try:
        while attacker.is_alive():
            outcome.asked += 1
            start = time.perf_counter()
            try:
                fd, _ = fetch_arena_fd(access, grant.lease.id, 0, timeout_s=10)
            except (WeightCacheError, OSError) as exc:
                outcome.errors.add(str(exc)[:100])
            else:
                os.close(fd)
                outcome.answered += 1
                outcome.slowest_s = max(outcome.slowest_s, time.perf_counter() - start)
            time.sleep(0.1)
    finally:
        attacker.join(seconds + 120)
        httpx.delete(f"{url}/v1/leases/{grant.lease.id}", timeout=30)
    return outcome
