"""This test process and the daemon's own (trusted) user; a live process's start time, as the
daemon records it for a holder it watches; the holder a caller proven as ``uid`` records for
process ``pid``; the caps of a registry of waiting engines."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from protocol.processes import process_status
from service.registry.lease_holders import Caller, Holder
from service.registry.waiting_rules import RoomWiring, WaitingCaps

ME = os.getpid()
OWNER = Caller.local()  # the daemon's own user: trusted


def start_of(pid: int) -> int | None:
    status = process_status(pid)
    return None if status is None else status.start


def holder_of(pid: int, uid: int | None) -> Holder:
    """Process ``pid`` of user ``uid``, watched if the daemon can see it."""
    return Holder(uid=uid, pid=pid, pid_start=start_of(pid), named_pid=pid)


def caps(total: int = 64, per_client: int = 64, per_uid: int = 64) -> WaitingCaps:
    """Caps on waiting engines: roomy unless a test says otherwise."""
    return WaitingCaps(total, per_uid, per_client)


def wiring(
    limits: WaitingCaps | None = None, on_change: Callable[[str], None] | None = None
) -> RoomWiring:
    """A waiting room's wiring in a daemon of its own (boot ``b00t``, a lock of its own)."""
    return RoomWiring("b00t", threading.RLock(), limits or caps(), on_change)
