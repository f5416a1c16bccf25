"""Waiting for a condition instead of sleeping: a test states what it waits for and how long it
may take at most, and goes on as soon as the condition holds. The one place tests poll."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T | None],
    timeout: float = 30.0,
    every: float = 0.05,
    what: str = "condition",
) -> T:
    """Poll ``predicate`` every ``every`` seconds until it returns something true, and return
    that. Fail the test (``AssertionError``) if it does not within ``timeout`` seconds, saying
    ``what`` was awaited."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} not reached in {timeout:g} s")
        time.sleep(every)
