"""A lease holder asking the handle socket for its descriptor, again and again, while a member
of the socket's group trickles bytes into many connections: for the hostile tests and
``bench.hostile``; and another process presenting what it learnt of a lease (or of a pending
donation) to the handle socket."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from harness.daemon_process import lease_body
from harness.hostile.users import NOBODY, run_attacker
from protocol.errors import WeightCacheError
from protocol.handle_socket import fetch_arena_fd
from protocol.schemas.leases import LeaseGrant
from protocol.schemas.manifest import HandleAccess, ShmHandle

# Presents a lease's access to the handle socket from another process; prints the outcome.
PRESENT = """
import json, os, sys
from protocol.errors import WeightCacheError
from protocol.handle_socket import fetch_arena_fd
from protocol.schemas.manifest import HandleAccess
access = HandleAccess.model_validate_json(sys.argv[1])
try:
    fd, size = fetch_arena_fd(access, sys.argv[2], 0)
except WeightCacheError as exc:
    reason = str(getattr(exc, "reason", ""))
    print(json.dumps({"code": exc.code, "why": exc.extra.get("why"), "reason": reason}))
else:
    os.close(fd)
    print(json.dumps({"size": size}))
"""


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


def present_elsewhere(
    access: HandleAccess, lease: str, prefix: list[str] | None = None
) -> dict[str, object]:
    """What the handle socket answers another process (run under ``prefix``, e.g. another
    user's ``setpriv``) that presents ``access`` for ``lease`` (a lease's id, or a pending
    donation's model id): ``code``, ``why`` and ``reason`` of a refusal, else ``size``."""
    out = subprocess.run(
        [*(prefix or []), sys.executable, "-c", PRESENT, access.model_dump_json(), lease],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    answer: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return answer
