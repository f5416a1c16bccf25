"""A released engine waits, before vLLM's memory snapshot, for the memory of the engine it
replaces: while NVML lists an ended process on its GPU, then until free memory stops growing.
The processes here are real (a zombie is an ended process the driver may still be freeing);
the GPU's readings are given as NVML and the driver would give them, and the wait's clock is
one that advances by exactly what it sleeps (a busy runner's late wake-ups change nothing)."""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from engine_client.freed_memory import GROWTH_BYTES, wait_for_freed_memory
from protocol.processes import process_ended

GIB = 1 << 30
POLL_S = 0.01


class SteppedClock:
    """``time`` for the wait: ``sleep`` advances ``monotonic`` by exactly what was asked."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(autouse=True)
def clock(monkeypatch: pytest.MonkeyPatch) -> SteppedClock:
    stepped = SteppedClock()
    monkeypatch.setattr("engine_client.freed_memory.time", stepped)
    return stepped


@pytest.fixture
def zombie() -> Iterator[int]:
    """A child that has exited and is not reaped yet."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
    yield child.pid
    child.wait()


def test_a_zombie_and_a_reaped_process_have_ended(zombie: int) -> None:
    assert process_ended(zombie) and not process_ended(os.getpid())
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    assert process_ended(int(done.stdout))


def test_waits_while_an_ended_process_is_listed_on_the_gpu(zombie: int) -> None:
    listings = [[os.getpid(), zombie]] * 5 + [[os.getpid()]]
    asked: list[list[int]] = []

    def gpu_pids() -> list[int]:
        asked.append(listings[min(len(asked), len(listings) - 1)])
        return asked[-1]

    wait_for_freed_memory(lambda: 80 * GIB, gpu_pids, timeout_s=5, quiet_s=0.05, poll_s=POLL_S)
    assert len(asked) == 6  # five listings with the ended process, then one without


def test_waits_until_free_memory_stops_growing() -> None:
    """The driver hands a killed engine's memory back in steps: free memory is read until it
    has not grown for quiet_s."""
    readings = iter([90 * GIB + i * GIB for i in range(10)])
    seen: list[int] = []

    def free_bytes() -> int:
        seen.append(next(readings, 99 * GIB))
        return seen[-1]

    wait_for_freed_memory(free_bytes, lambda: None, timeout_s=5, quiet_s=0.1, poll_s=POLL_S)
    assert seen[9] == 99 * GIB and len(seen) >= 10 + int(0.1 / POLL_S) - 1


def test_small_changes_count_as_settled() -> None:
    readings = itertools.count(0, GROWTH_BYTES // 4)  # growing in steps below the threshold
    waited = wait_for_freed_memory(
        lambda: next(readings, 0), lambda: None, timeout_s=5, quiet_s=0.05, poll_s=POLL_S
    )
    assert waited < 1


def test_gives_up_at_the_timeout_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    growing = iter(range(0, 10**6 * GIB, GIB))
    with caplog.at_level(logging.WARNING, logger="engine_client.freed_memory"):
        waited = wait_for_freed_memory(
            lambda: next(growing), lambda: None, timeout_s=0.3, quiet_s=0.1, poll_s=POLL_S
        )
    assert waited >= 0.3
    assert "still changing" in caplog.text
