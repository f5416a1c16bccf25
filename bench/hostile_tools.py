"""What the hostile benchmark's cases share: the daemon they attack, raw sockets (the hostile
tests' own, :mod:`harness.hostile.sockets`), checkpoint copies made of hard links, the daemon's
resident memory, and acting as another user (:class:`harness.hostile.users.UserAgent`)."""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harness.daemon_process import DaemonProcess
from harness.hostile import sockets
from harness.hostile.memory import rss_bytes
from harness.hostile.users import UserAgent


@dataclass
class Target:
    """The daemon a case attacks, the checkpoint it serves, and what this build of it knows."""

    daemon: DaemonProcess
    model: Path  # the checkpoint it serves as "qwen"
    current: bool  # a daemon of this tree (False: an earlier build, for before/after figures)
    tree: Path | None = None  # that earlier build's source tree

    @property
    def url(self) -> str:
        return self.daemon.url

    @property
    def pid(self) -> int:
        return self.daemon.process.pid

    def rss_mb(self) -> float:
        return rss_bytes(self.pid) / 2**20


Result = tuple[int, int, str]  # tried, held (answered as intended), how
Case = Callable[[Target, Path], Result]


def connect(target: Target, rcvbuf: int | None = None) -> socket.socket:
    return sockets.connect(target.daemon.port, rcvbuf, timeout_s=30)


def send_until_answered(target: Target, head: bytes, chunk: bytes, most: int) -> tuple[int, bytes]:
    return sockets.send_until_answered(target.daemon.port, head, chunk, most, timeout_s=30)


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


def as_user(uid: int, url: str, lease_id: str) -> dict[str, object]:
    """What user ``uid`` sees of the leases, and its attempts to end and renew ``lease_id``."""
    with UserAgent(url, uid) as user:
        status, listed = user.request("GET", "/v1/leases")
        ids = [x["id"] for x in listed] if status == 200 else []
        tried = [
            user.request("DELETE", f"/v1/leases/{lease_id}")[0],
            user.request("POST", f"/v1/leases/{lease_id}/renew")[0],
        ]
    return {"listed": ids, "tried": tried}
