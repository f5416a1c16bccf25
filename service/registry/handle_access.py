"""Who may have a lease's descriptors (or a pending donation's, for its donor to write): the
one decision the handle socket asks.

A peer gets them only with the lease's secret (handed out with the grant), as the lease's
holder's user (``Lease.holder.uid``, proven when the lease was granted:
:mod:`service.registry.lease_holders`) or a user the daemon trusts (its own, or root), and, when
the kernel shows its process to the daemon, as the process the lease was granted to. The peer's
credentials come from the kernel (``SO_PEERCRED``), not from the peer: its pid is 0 when it
lives in a PID namespace the daemon cannot see (another container), and then the secret and the
uid decide alone. An engine in a PID namespace nested in the daemon's names itself by its own
pid in the lease, which ``/proc/<pid>/status`` (``NSpid``) relates to the pid the daemon sees.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from service.registry.lease_holders import Holder


class Claim(Protocol):
    """What the handle socket passes descriptors for: a lease, or a pending donation (whose
    donor writes its arena), each with its secret and its proven holder."""

    @property
    def secret(self) -> str: ...

    @property
    def holder(self) -> Holder: ...


@dataclass(frozen=True)
class Peer:
    """A connected process, as the kernel reported it."""

    pid: int  # 0: in a PID namespace this daemon cannot see
    uid: int
    gid: int


def pids_of(pid: int) -> set[int]:
    """``pid`` and the pids the same process has in nested PID namespaces (``NSpid``), as far
    as ``/proc`` shows them."""
    pids = {pid}
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return pids
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            pids.update(int(p) for p in line.split()[1:] if p.isdigit())
    return pids


def holder_refusal(lease: Claim, secret: str, peer: Peer, uids: frozenset[int]) -> str | None:
    """Why ``peer``, presenting ``secret``, may not have ``lease``'s descriptors (a lease's or
    a pending donation's); None if it may. (The holder fields are compared here and nowhere
    else.)"""
    if not hmac.compare_digest(lease.secret.encode(), secret.encode()):
        return "the secret is not this lease's"
    holder = lease.holder
    if peer.uid not in uids and peer.uid != holder.uid:
        return (
            f"uid {peer.uid} is not the lease holder's (uid {holder.uid}), the daemon's "
            "user or root"
        )
    if peer.pid != 0:
        theirs = pids_of(peer.pid)
        if holder.named_pid not in theirs and holder.pid not in theirs:
            return f"process {peer.pid} is not the lease's holder (pid {holder.shown_pid})"
    return None
