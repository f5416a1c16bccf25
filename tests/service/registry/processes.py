"""A live process's start time, as the daemon records it for a holder it watches."""

from __future__ import annotations

from protocol.processes import process_status


def start_of(pid: int) -> int | None:
    status = process_status(pid)
    return None if status is None else status.start
