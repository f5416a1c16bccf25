"""Long-polls that hold no worker thread: a request waits on an ``asyncio.Event`` on the loop,
which the registries set (from any thread) when the state it waits on changes.

A waiter takes its event before it reads the state, so a change between the read and the wait
is never missed; events live only while someone waits on them, so ids a client makes up cost
nothing once it stops asking.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from starlette.concurrency import run_in_threadpool

T = TypeVar("T")


class Waits:
    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: dict[str, tuple[asyncio.Event, int]] = {}  # id -> (event, waiters)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop the waiters run on (the app's, known once it starts)."""
        self._loop = loop

    def wake(self, key: str) -> None:
        """Wake everyone waiting on ``key``; callable from any thread."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._set, key)

    def _set(self, key: str) -> None:
        held = self._events.get(key)
        if held is not None:
            held[0].set()

    @contextlib.asynccontextmanager
    async def watch(self, key: str) -> AsyncIterator[asyncio.Event]:
        event, waiters = self._events.get(key) or (asyncio.Event(), 0)
        self._events[key] = (event, waiters + 1)
        try:
            yield event
        finally:
            event, waiters = self._events[key]
            if waiters <= 1:
                del self._events[key]
            else:
                self._events[key] = (event, waiters - 1)

    async def until(
        self,
        key: str,
        read: Callable[[], T],
        done: Callable[[T], bool],
        wait_s: float,
    ) -> T:
        """``read()`` (in a worker thread: it takes the daemon's lock) again each time ``key``
        changes, until ``done`` holds for what it read or ``wait_s`` has passed; the last read.
        Between reads the request holds no thread."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            async with self.watch(key) as event:
                state = await run_in_threadpool(read)
                left = deadline - loop.time()
                if done(state) or left <= 0:
                    return state
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(event.wait(), left)
