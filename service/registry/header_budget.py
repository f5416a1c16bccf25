"""The memory the loads running at once may spend before they allocate a byte of arena.

What opening and planning a checkpoint costs grows with its safetensors headers: the parsed
entries, the tensor index and the plan take about eight times the headers' bytes while a load
runs (a 5.8 MB header of 63,000 entries, about 40 MB), and what several such loads at once
leave scattered in the heap is not all given back once they end. ``--max-concurrent-loads``
bounds how many loads run; this bounds what they hold together: the loads running at once may
have at most ``LOADING_HEADER_BYTES`` of headers (real ones are about 100 KB: dozens run side
by side), a load whose headers pass it alone runs alone, and a load whose headers do not fit
waits, before it reads them, until others end (an unload stops the wait).
"""

from __future__ import annotations

import threading

LOADING_HEADER_BYTES = 4 << 20
_CHECK_CANCEL_S = 0.2  # how often a waiting load looks whether it was unloaded


class HeaderBudget:
    def __init__(self, nbytes: int = LOADING_HEADER_BYTES) -> None:
        self.nbytes = nbytes
        self._held = 0
        self.waiting = 0  # loads waiting for room
        self._room = threading.Condition()

    def claim(self, nbytes: int, cancelled: threading.Event) -> bool:
        """Wait until ``nbytes`` fit beside what the other loads hold, then hold them; False
        (holding nothing) if ``cancelled`` was set first."""
        nbytes = min(nbytes, self.nbytes)
        with self._room:
            self.waiting += 1
            try:
                while self._held + nbytes > self.nbytes:
                    if cancelled.is_set():
                        return False
                    self._room.wait(_CHECK_CANCEL_S)
            finally:
                self.waiting -= 1
            self._held += nbytes
        return True

    def release(self, nbytes: int) -> None:
        with self._room:
            self._held -= min(nbytes, self.nbytes)
            self._room.notify_all()

    @property
    def held(self) -> int:
        return self._held
