"""What ``/proc`` says of a process, read alike by the daemon (watching lease holders and
waiting engines) and the engine side (waiting for an ended engine's GPU memory)."""

from __future__ import annotations

import os
from typing import NamedTuple


class ProcessStatus(NamedTuple):
    owner: int  # the uid that owns the process
    start: int  # its start time in clock ticks (tells it from a later one with its pid)
    state: str  # its state letter (Z: a zombie)
    parent: int  # its parent's pid

    @property
    def ended(self) -> bool:
        """A zombie its parent has not reaped, or one being torn down: it runs no more."""
        return self.state in ("Z", "X")


def process_status(pid: int) -> ProcessStatus | None:
    """Owner, start time and state of ``pid``, if visible: its /proc directory opened once, and
    its ``stat`` read through that (the same process, even if the pid is reused meanwhile). The
    owner is the directory's: a process that changed its uid is not dumpable, and the files
    inside then show root."""
    try:
        folder = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        owner = os.fstat(folder).st_uid
        fd = os.open("stat", os.O_RDONLY, dir_fd=folder)
        try:
            stat = os.read(fd, 4096).decode(errors="replace")
        finally:
            os.close(fd)
    except OSError:
        return None
    finally:
        os.close(folder)
    # The command name may hold spaces and parentheses: split after its closing ")".
    fields = stat[stat.rindex(")") + 2 :].split()
    return ProcessStatus(owner, int(fields[19]), fields[0], int(fields[1]))


def process_ended(pid: int) -> bool:
    """Whether ``pid`` has ended: no such process, or a zombie its parent has not reaped."""
    status = process_status(pid)
    return status is None or status.ended


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it, read from ``/proc`` (none if ``root`` is gone)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            status = process_status(int(entry))
            if status is not None:
                children.setdefault(status.parent, []).append(int(entry))
    if process_status(root) is None:
        return []
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree
