"""A live process's start time, as the daemon records it for a holder it watches, and the holder
a caller proven as ``uid`` records for process ``pid``."""

from __future__ import annotations

from protocol.processes import process_status
from service.registry.lease_holders import Holder


def start_of(pid: int) -> int | None:
    status = process_status(pid)
    return None if status is None else status.start


def holder_of(pid: int, uid: int | None) -> Holder:
    """Process ``pid`` of user ``uid``, watched if the daemon can see it."""
    return Holder(uid=uid, pid=pid, pid_start=start_of(pid), named_pid=pid)
