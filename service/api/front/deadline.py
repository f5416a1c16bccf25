"""A timer on the event loop that is armed, disarmed and armed again: a request's deadline, an
answer's drain, a refused request's lingering."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Deadline:
    def __init__(
        self, loop: asyncio.AbstractEventLoop, seconds: float, expired: Callable[[], None]
    ) -> None:
        self.loop = loop
        self.seconds = seconds
        self.expired = expired
        self._timer: asyncio.TimerHandle | None = None

    @property
    def armed(self) -> bool:
        return self._timer is not None

    def arm(self) -> None:
        """Start counting, unless already counting (the first arming decides)."""
        if self._timer is None:
            self._timer = self.loop.call_later(self.seconds, self._fire)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        self._timer = None
        self.expired()
