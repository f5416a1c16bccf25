"""Noticing the moment a watched process ends, instead of at the next sweep.

A warm standby takes over when the engine serving its model ends; the periodic sweep finds a
dead holder up to ``--reaper-interval`` later (a second by default), most of the takeover's
budget. The kernel says it at once: a pidfd (``pidfd_open``) turns readable when its process
exits. One thread polls a pidfd per watched process (lease holders and waiting engines, as
``(pid, start time)``) and runs the sweep as soon as one ends; the sweep then decides, with its
``/proc`` check, what ended. It holds at most ``max_pidfds`` descriptors (a neighbour with many
leases or registrations, each from a process of its own, must not take the daemon's descriptors
from its connections): processes past that are noticed by the periodic sweep alone. Where pidfds
are not available (Linux before 5.3, a seccomp
profile that refuses the call) the periodic sweep alone remains, as before.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
from collections.abc import Callable

from protocol.logsafe import get_logger
from service.memory.devices import process_alive

log = get_logger(__name__)

REFRESH_S = 0.5  # the watched set is read again at least this often
MAX_PIDFDS = 256  # descriptors held at most; beyond, the periodic sweep notices ends


class ExitWatch:
    def __init__(
        self,
        watched: Callable[[], set[tuple[int, int]]],
        on_exit: Callable[[], object],
        refresh_s: float = REFRESH_S,
        max_pidfds: int = MAX_PIDFDS,
    ) -> None:
        self.watched = watched  # (pid, start) of every process whose end matters
        self.on_exit = on_exit  # the sweep
        self.refresh_s = refresh_s
        self.max_pidfds = max_pidfds
        self._past_cap = 0  # processes not watched here at the last refresh (logged on change)
        self._fds: dict[tuple[int, int], int] = {}
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread: threading.Thread | None = None

    @staticmethod
    def available() -> bool:
        """Whether this kernel and process may open pidfds."""
        try:
            fd = os.pidfd_open(os.getpid())
        except (AttributeError, OSError):
            return False
        os.close(fd)
        return True

    def start(self) -> bool:
        if not self.available():
            log.warning(
                "pidfds are not available here: ended engines are noticed by the periodic "
                "sweep only (--reaper-interval)"
            )
            return False
        self._thread = threading.Thread(target=self._run, name="exit-watch", daemon=True)
        self._thread.start()
        return True

    def poke(self) -> None:
        """Read the watched set again now (a lease or registration was just added)."""
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self.poke()
        if self._thread is not None:
            self._thread.join(5)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # --- the thread --------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                ended = self._refresh() or self._wait()
                if ended and not self._stop.is_set():
                    self.on_exit()
            except Exception:  # the periodic sweep still runs; never let this thread die
                log.exception("exit watch: one turn failed")
                self._stop.wait(self.refresh_s)

    def _refresh(self) -> bool:
        """Open pidfds for newly watched processes, close those no longer watched; True if a
        newly watched process has already ended."""
        wanted = self.watched()
        for key in [k for k in self._fds if k not in wanted]:
            os.close(self._fds.pop(key))
        room = max(0, self.max_pidfds - len(self._fds))
        new = sorted(wanted - self._fds.keys())
        if len(new) - room != self._past_cap:
            self._past_cap = max(0, len(new) - room)
            if self._past_cap:
                log.warning(
                    "exit watch: %d process(es) past the %d watched through pidfds: their end "
                    "is noticed by the periodic sweep",
                    self._past_cap,
                    self.max_pidfds,
                )
        ended = False
        for pid, start in new[:room]:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                ended = True
                continue
            except OSError as exc:  # EMFILE and the like: the periodic sweep covers it
                log.debug("exit watch: no pidfd for pid %d: %s", pid, exc)
                continue
            if not process_alive(pid, start):  # ended, or the PID names another process now
                os.close(fd)
                ended = True
                continue
            self._fds[(pid, start)] = fd
        return ended

    def _wait(self) -> bool:
        """Poll every pidfd and the wake pipe for up to ``refresh_s``; True if one ended."""
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        by_fd = {fd: key for key, fd in self._fds.items()}
        for fd in by_fd:
            poller.register(fd, select.POLLIN)
        ready = poller.poll(self.refresh_s * 1000)
        ended = False
        for fd, _ in ready:
            if fd == self._wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
                continue
            key = by_fd[fd]
            os.close(self._fds.pop(key))
            ended = True
        return ended
