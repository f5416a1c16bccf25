"""The daemon's resident memory around a hostile case: what a case costs must be given back once
it ends (within ``SLACK_BYTES`` of where it started), whatever the attacker sent."""

from __future__ import annotations

from pathlib import Path
from types import TracebackType

from harness.waiting import wait_for

SLACK_BYTES = 50 * 1024 * 1024


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (``VmRSS`` of its status), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


class RssBack:
    """``with RssBack(pid):`` around a case: afterwards the process's RSS comes back within
    ``SLACK_BYTES`` of its start (waited for, as freed memory is returned asynchronously)."""

    def __init__(self, pid: int, timeout_s: float = 30.0) -> None:
        self.pid = pid
        self.timeout_s = timeout_s
        self.start = 0

    def __enter__(self) -> RssBack:
        self.start = rss_bytes(self.pid)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if kind is not None:
            return
        try:
            wait_for(lambda: rss_bytes(self.pid) <= self.start + SLACK_BYTES, self.timeout_s)
        except AssertionError:
            now = rss_bytes(self.pid)
            raise AssertionError(
                f"RSS {self.start >> 20} MiB before the case, {now >> 20} MiB after it"
            ) from None
