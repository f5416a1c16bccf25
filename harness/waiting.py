"""Waiting for a condition instead of sleeping: a caller states what it waits for and how long it
may take at most, and goes on as soon as the condition holds. The one place tests, proofs and
benchmarks poll."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def poll(
    predicate: Callable[[], T | None],
    timeout: float,
    every: float = 0.05,
    while_: Callable[[], bool] = lambda: True,
) -> T | None:
    """Call ``predicate`` every ``every`` seconds until it returns something true, and return
    that; ``None`` once ``timeout`` seconds have passed or ``while_`` says it is no use waiting
    any longer (the process that was to answer has ended). For a proof that reports what did
    not happen; a test asserts with :func:`wait_for`."""
    deadline = time.monotonic() + timeout
    while while_():
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            return None
        time.sleep(every)
    return None


def wait_for(
    predicate: Callable[[], T | None],
    timeout: float = 30.0,
    every: float = 0.05,
    what: str = "condition",
) -> T:
    """Poll ``predicate`` every ``every`` seconds until it returns something true, and return
    that. Fail the test (``AssertionError``) if it does not within ``timeout`` seconds, saying
    ``what`` was awaited."""
    value = poll(predicate, timeout, every)
    if not value:
        raise AssertionError(f"{what} not reached in {timeout:g} s")
    return value
