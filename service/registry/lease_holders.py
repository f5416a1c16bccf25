"""Who holds a lease, and who may touch it.

A lease is tied to its caller as the kernel proved it (peer credentials: ``SO_PEERCRED`` on the
Unix socket, the owner of the client's socket on loopback TCP), never to what a request body
says alone:

- The lease's process (``client_pid``) must be one the daemon can see and watch, and belong to
  the caller's user; else it is refused (``client_not_visible``, ``client_not_yours``). Over the
  Unix socket the kernel names the caller's process itself: a caller in another PID namespace
  (the kernel says pid 0) holds its lease by its uid alone, unwatched (its TTL ends it), and
  one whose ``client_pid`` is not visible holds it by the process that connected. A caller
  that showed the daemon's token (an engine in another container, over TCP) holds a lease for a
  process out of sight unwatched, as one in another PID namespace does; one that connects from
  another network namespace or host (its uid unknown) always does, its pid naming nothing here.
- A lease is read, renewed or released, and listed, only by its holder's user or by a trusted
  caller: one that showed the daemon's token, root, or the daemon's own user (they could read
  its memory anyway).
- The caps count per user as well as per process, so one user cannot take the others' room.

``Holder`` is what a lease, a parked engine and a start-up slot ticket record of their caller
(``Lease.holder``, ``Registration.holder``); the daemon's handle socket hands file descriptors
only to a live lease's holder by the same record
(:func:`service.registry.handle_access.holder_refusal`). The lease desk
(:mod:`service.registry.lease_desk`) proves every holder, outside the daemon's lock.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from protocol.errors import ClientNotVisibleError, ClientNotYoursError
from protocol.processes import process_status


def trusted_uids() -> frozenset[int]:
    """Users trusted with every lease and descriptor: the daemon's own, and root."""
    return frozenset({os.geteuid(), 0})


@dataclass(frozen=True)
class Caller:
    """Who sent a request, as far as the kernel and the token prove it."""

    uid: int | None  # None: not known (a remote peer behind the token)
    pid: int | None  # a process in the daemon's PID namespace (Unix socket peers only)
    token: bool = False  # showed the daemon's token
    via: str = "tcp"  # "unix", "tcp", or "local" (no socket: the daemon's own process)

    @classmethod
    def local(cls) -> Caller:
        """This process itself (a call that came through no socket)."""
        return cls(uid=os.geteuid(), pid=os.getpid(), via="local")

    @property
    def trusted(self) -> bool:
        """May act on every lease: a token holder, root, or the daemon's own user."""
        return self.token or self.uid in trusted_uids()

    def may_manage(self, holder_uid: int | None) -> bool:
        """Whether this caller may read, renew or release a lease held by ``holder_uid``."""
        return self.trusted or (self.uid is not None and self.uid == holder_uid)


# How a lease's flat records (``LeaseInfo``, the keeper's ``KeptLease``) spell its holder.
FLAT_FIELDS = ("client_pid", "holder_uid", "holder_pid", "pid_start")


@dataclass(frozen=True)
class Holder:
    """What a lease, a parked engine or a start-up slot ticket records of its caller: the one
    holder record the registry keeps for all three (:func:`prove_holder` makes it)."""

    uid: int | None  # the caller's proven uid (None: a remote token holder)
    pid: int | None  # the process watched (None: not visible, TTL only)
    pid_start: int | None  # that process's start time, to tell it from a later reuse
    named_pid: int  # the pid the request named (``client_pid``)

    @property
    def watched(self) -> bool:
        return self.pid is not None and self.pid_start is not None

    @property
    def process(self) -> tuple[int, int] | None:
        """(PID, start) of the process watched, if any (what the sweep checks)."""
        if self.pid is None or self.pid_start is None:
            return None
        return (self.pid, self.pid_start)

    @property
    def watched_pid(self) -> int | None:
        """The process the daemon watches for it, if any (what per-process caps count)."""
        return self.pid if self.watched else None

    @property
    def shown_pid(self) -> int:
        """The pid a waiting engine's answer shows: the proven one, else the one named."""
        return self.pid if self.pid is not None else self.named_pid

    def fields(self) -> dict[str, int | None]:
        """The holder as a lease's flat records spell it (``LeaseInfo``, the keeper's
        ``KeptLease``)."""
        return dict(
            zip(FLAT_FIELDS, (self.named_pid, self.uid, self.pid, self.pid_start), strict=True)
        )

    @classmethod
    def from_fields(cls, flat: Mapping[str, Any]) -> Holder:
        """The holder :meth:`fields` wrote."""
        named, uid, pid, start = (flat[name] for name in FLAT_FIELDS)
        return cls(uid=uid, pid=pid, pid_start=start, named_pid=named)


def _visible(pid: int) -> tuple[int, int] | None:
    """(owner uid, start time) of a live process the daemon can see, else ``None`` (one read
    of /proc: this is on every grant's path)."""
    status = process_status(pid)
    if status is None or status.ended:
        return None
    return status.owner, status.start


def prove_holder(caller: Caller, client_pid: int) -> Holder:
    """The holder a lease for ``client_pid`` asked by ``caller`` records, or the typed refusal.
    Blocking (reads ``/proc``): call it outside the daemon's lock."""
    named = client_pid
    if caller.via == "unix" and caller.pid is None:
        # The kernel said pid 0: the caller lives in another PID namespace, and client_pid is a
        # number of that namespace. Its uid is proven; nothing here can watch its process.
        return Holder(uid=caller.uid, pid=None, pid_start=None, named_pid=named)
    if caller.via == "tcp" and caller.uid is None and caller.token:
        # A peer in another network namespace or host (an engine in a container of its own):
        # its client_pid is a number of its own PID namespace and names nothing here, even
        # where a process of ours has that number. Its TTL ends what it no longer renews.
        return Holder(uid=None, pid=None, pid_start=None, named_pid=named)
    seen = _visible(client_pid)
    if seen is None and caller.via == "unix" and caller.pid is not None:
        client_pid, seen = caller.pid, _visible(caller.pid)  # the process that connected
    if seen is None and caller.token:
        # An engine in another container or pod, over TCP with the daemon's token: the
        # operator vouched for it, and its TTL ends what its process no longer renews.
        return Holder(uid=caller.uid, pid=None, pid_start=None, named_pid=named)
    if seen is None:
        raise ClientNotVisibleError(
            f"client_pid {client_pid} is not a process this daemon can see, so it could not "
            "tell when the lease's engine is gone",
            client_pid=client_pid,
        )
    owner, started = seen
    if not caller.trusted and owner != caller.uid:
        raise ClientNotYoursError(
            f"client_pid {client_pid} belongs to uid {owner}, the request comes from uid "
            f"{caller.uid}",
            client_pid=client_pid,
        )
    return Holder(uid=caller.uid, pid=client_pid, pid_start=started, named_pid=named)
