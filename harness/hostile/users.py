"""Acting as another local user: a Python process that starts as root (so it can import what it
needs from this checkout), drops to ``uid`` and then talks to the daemon, reporting each answer
as a line of JSON and staying alive (its leases watched) until told to go."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

NOBODY = 65534
OTHER = 65533  # a second unprivileged user (no passwd entry needed)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users")

_AGENT = r"""
import json, os, sys
import httpx
uid, gid, url, uds = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] or None
# One request as root first: everything httpx imports lazily is imported before the drop.
transport = httpx.HTTPTransport(uds=uds) if uds else None
with httpx.Client(base_url=url, transport=transport, timeout=30) as warm:
    warm.get("/health").json()
os.setgroups([gid]); os.setgid(gid); os.setuid(uid)
print(json.dumps({"pid": os.getpid(), "uid": os.getuid()}), flush=True)
for line in sys.stdin:
    order = json.loads(line)
    transport = httpx.HTTPTransport(uds=order["uds"]) if order.get("uds") else None
    try:
        with httpx.Client(base_url=order["url"], transport=transport, timeout=30) as c:
            r = c.request(order["method"], order["path"], json=order.get("json"),
                          headers=order.get("headers") or {})
        body = r.json() if r.content else None
        print(json.dumps({"status": r.status_code, "body": body}), flush=True)
    except (httpx.HTTPError, OSError, ValueError) as exc:
        print(json.dumps({"status": 0, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
"""


class UserAgent:
    """A process of ``uid`` (group ``gid``) making the requests it is given, one at a time."""

    def __init__(self, url: str, uid: int, gid: int | None = None, uds: str | None = None):
        self.url = url
        self.uds = uds
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _AGENT,
                str(uid),
                str(uid if gid is None else gid),
                url,
                uds or "",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        hello = json.loads(self.process.stdout.readline())
        self.pid: int = hello["pid"]
        self.uid: int = hello["uid"]

    def request(
        self, method: str, path: str, json_body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        order = {
            "url": self.url,
            "uds": self.uds,
            "method": method,
            "path": path,
            "json": json_body,
            "headers": headers,
        }
        self.process.stdin.write(json.dumps(order) + "\n")
        self.process.stdin.flush()
        answer = json.loads(self.process.stdout.readline())
        return answer["status"], answer["body"] if "body" in answer else answer["error"]

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(30)

    def __enter__(self) -> UserAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def process_of(uid: int) -> Iterator[subprocess.Popen[bytes]]:
    """A live process of ``uid`` (a victim whose PID a neighbour names), until the block ends."""
    victim = subprocess.Popen(
        ["cat"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        user=uid,
        group=uid,
        extra_groups=[],
    )
    try:
        yield victim
    finally:
        assert victim.stdin is not None
        victim.stdin.close()
        victim.wait(30)


def run_as(
    uid: int,
    gid: int,
    code: str,
    *args: str,
    groups: tuple[int, ...] = (),
    timeout_s: float = 30,
    imports: tuple[str, ...] = (),
) -> str:
    """What Python ``code`` (given ``args``) prints when run as ``uid`` and ``gid`` with the
    supplementary ``groups`` alone, else its error. The modules it uses are imported first, as
    root (the checkout's environment need not be readable by that user), and ``imports``
    with them."""
    drop = (
        f"import {', '.join(('os', 'socket', 'sys', *imports))}\n"
        f"os.setgroups({list(groups)!r}); os.setgid({gid}); os.setuid({uid})\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", drop + code, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    return out.stdout.strip() or out.stderr.strip()


def run_attacker(uid: int, name: str, groups: tuple[int, ...] = (), **args: Any) -> dict[str, Any]:
    """What :mod:`harness.hostile.attackers`' ``name`` saw, run with ``args`` as ``uid`` (its
    group ``uid`` too) and the supplementary ``groups``: bytes as latin-1 text, as JSON carries
    them."""
    wire = {k: v.decode("latin-1") if isinstance(v, bytes) else v for k, v in args.items()}
    kinds: dict[str, tuple[bytes, int]] = args.get("kinds", {})
    if kinds:
        wire["kinds"] = {k: (head.decode("latin-1"), n) for k, (head, n) in kinds.items()}
    code = "from harness.hostile.attackers import main\nmain()\n"
    seconds = float(args.get("seconds", 0))
    out = run_as(
        uid,
        uid,
        code,
        name,
        json.dumps(wire),
        groups=groups,
        timeout_s=seconds + 60,
        imports=("harness.hostile.attackers",),
    )
    try:
        answer: dict[str, Any] = json.loads(out.splitlines()[-1])
    except (IndexError, ValueError):
        raise AssertionError(f"the attacker {name} failed: {out[-2000:]}") from None
    return answer
