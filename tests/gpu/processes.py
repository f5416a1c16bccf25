"""Processes the GPU proofs start: each in its own session (so a kill reaches its children, as
vLLM's EngineCore), its output read line by line and stamped with the seconds since its start,
kept in memory for the proof to wait on and parse, and written to a log file.

The stamps are the proof's own clock: vLLM's log lines carry whole seconds only, and a restart's
phases are measured in tenths.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from protocol.processes import process_tree


@dataclass(frozen=True)
class Line:
    """One line of output, ``t`` seconds after the process started."""

    t: float
    text: str


class LoggedProcess:
    """A process whose stdout and stderr are read into stamped lines and a log file."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self._lines: list[Line] = []
        self._changed = threading.Condition()
        self._log = log_path.open("w", encoding="utf-8")
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, name=f"log-{name}", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def since_start(self, moment: float | None = None) -> float:
        """Seconds from this process's start to ``moment`` (a ``time.monotonic()``; now if
        None)."""
        return (time.monotonic() if moment is None else moment) - self.started

    def _read(self) -> None:
        assert self.process.stdout is not None
        for raw in iter(self.process.stdout.readline, b""):
            line = Line(self.since_start(), raw.decode("utf-8", "replace").rstrip("\r\n"))
            with self._changed:
                self._lines.append(line)
                self._log.write(f"{line.t:9.3f} {line.text}\n")
                self._log.flush()
                self._changed.notify_all()
        with self._changed:
            self._log.close()
            self._changed.notify_all()

    def lines(self) -> list[Line]:
        with self._changed:
            return list(self._lines)

    def text(self) -> str:
        return "\n".join(line.text for line in self.lines())

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_line(self, pattern: str | re.Pattern[str], timeout: float) -> Line | None:
        """The first line matching ``pattern``, waiting for it up to ``timeout`` seconds; None
        if the process ended (its output read to the end) or the time ran out first."""
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        seen = 0
        with self._changed:
            while True:
                for line in self._lines[seen:]:
                    if regex.search(line.text):
                        return line
                seen = len(self._lines)
                left = deadline - time.monotonic()
                if left <= 0 or (self._log.closed and self.process.poll() is not None):
                    return None
                self._changed.wait(min(left, 0.5))

    def wait_exit(self, timeout: float) -> int | None:
        """The exit status once the process ends within ``timeout``; None if it still runs."""
        try:
            code = self.process.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            return None
        self._reader.join(5)
        return code

    def signal(self, sig: int, group: bool = True) -> None:
        """Send ``sig`` to the process's whole session (its children too) or to it alone."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group:
                os.killpg(self.process.pid, sig)
            else:
                os.kill(self.process.pid, sig)

    def stop(self, grace_s: float = 10.0) -> int:
        """SIGTERM to the session, SIGKILL to what is left after ``grace_s``; its exit status."""
        if self.alive():
            self.signal(signal.SIGTERM)
            if self.wait_exit(grace_s) is None:
                self.signal(signal.SIGKILL)
        code = self.process.wait()
        # Children that outlived the leader (vLLM's EngineCore) go with the session.
        self.signal(signal.SIGKILL)
        self._reader.join(5)
        return code

    def descendants(self) -> list[int]:
        """This process and every process below it, from ``/proc`` (Linux)."""
        return process_tree(self.pid)


def read_chars(pid: int) -> int | None:
    """Bytes a process has read through ``read()`` and kin so far (``rchar`` of
    ``/proc/<pid>/io``: page-cache hits included), or None where it cannot be read."""
    try:
        for row in Path(f"/proc/{pid}/io").read_text().splitlines():
            key, _, value = row.partition(":")
            if key == "rchar":
                return int(value)
    except (OSError, ValueError):
        return None
    return None
