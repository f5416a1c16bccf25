"""What ``/proc`` says of a process, read alike by the daemon (watching lease holders and
waiting engines) and the engine side (waiting for an ended engine's GPU memory)."""

from __future__ import annotations

from pathlib import Path


def process_start(pid: int) -> tuple[int, str] | None:
    """(start time in clock ticks, state letter) from /proc/<pid>/stat, if visible."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: split after its closing ")".
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19]), fields[0]


def process_ended(pid: int) -> bool:
    """Whether ``pid`` has ended: no such process, or a zombie its parent has not reaped."""
    started = process_start(pid)
    return started is None or started[1] in ("Z", "X")
