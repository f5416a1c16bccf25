"""What the hostile benchmark's cases share: the daemon they attack, raw sockets, checkpoint
copies made of hard links, the daemon's resident memory, and acting as another user."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.daemon_process import DaemonProcess
from tests.hostile.memory import rss_bytes


@dataclass
class Target:
    """The daemon a case attacks, the checkpoint it serves, and what this build of it knows."""

    daemon: DaemonProcess
    model: Path  # the checkpoint it serves as "qwen"
    current: bool  # a daemon of this tree (False: an earlier build, for before/after figures)

    @property
    def url(self) -> str:
        return self.daemon.url

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def pid(self) -> int:
        return self.daemon.process.pid

    def rss_mb(self) -> float:
        return rss_bytes(self.pid) / 2**20


Result = tuple[int, int, str]  # tried, held (answered as intended), how
Case = Callable[[Target, Path], Result]


def connect(target: Target, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(30)
    s.connect(("127.0.0.1", target.port))
    return s


def status_of(s: socket.socket) -> int:
    """The status of what the daemon wrote before closing (0: nothing)."""
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


def send_until_closed(s: socket.socket, head: bytes, chunk: bytes, most: int) -> int:
    """Send ``head``, then ``chunk`` until ``most`` bytes or the daemon closes: bytes sent."""
    sent = 0
    try:
        s.sendall(head)
        while sent < most:
            s.sendall(chunk)
            sent += len(chunk)
    except OSError:
        pass
    return sent


def linked_copy(work: Path, src: Path, name: str) -> Path:
    """A copy of checkpoint ``src`` made of hard links (a broken copy costs no disk)."""
    path = work / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir()
    for f in src.iterdir():
        os.link(f, path / f.name)
    return path


def replace_file(path: Path, data: bytes) -> None:
    """Replace a (hard-linked) file by a new one, leaving the original's other names alone."""
    path.unlink()
    path.write_bytes(data)


AS_USER = r"""
import json, os, sys
import httpx
uid, url, lease = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
with httpx.Client(base_url=url, timeout=30) as warm:
    warm.get("/health")
os.setgroups([]); os.setgid(uid); os.setuid(uid)
with httpx.Client(base_url=url, timeout=30) as c:
    listed = c.get("/v1/leases")
    ids = [x["id"] for x in listed.json()] if listed.status_code == 200 else []
    tried = [c.delete(f"/v1/leases/{lease}").status_code,
             c.post(f"/v1/leases/{lease}/renew").status_code]
print(json.dumps({"listed": ids, "tried": tried}))
"""


def as_user(uid: int, url: str, lease_id: str) -> dict[str, object]:
    """What user ``uid`` sees of the leases, and its attempts to end and renew ``lease_id``."""
    out = subprocess.run(
        [sys.executable, "-c", AS_USER, str(uid), url, json.dumps(lease_id)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    answer: dict[str, object] = json.loads(out.stdout)
    return answer
