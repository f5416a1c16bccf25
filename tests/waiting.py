"""Waiting for a condition instead of sleeping: a test states what it waits for and how long it
may take at most, and goes on as soon as the condition holds."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(predicate: Callable[[], object], timeout: float = 30.0, every: float = 0.05) -> None:
    """Poll ``predicate`` until it holds; fail the test if it does not within ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(every)
