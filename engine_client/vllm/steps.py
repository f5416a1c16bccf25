"""A load as a list of named steps, each timed, each with the reason an unexpected failure in
it is reported under. The list itself is :data:`engine_client.vllm.load_steps.LOAD_STEPS`."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from engine_client.fallback import typed_failures
from protocol.reasons import Reason

__all__ = ["Step", "StepTimes", "run_steps"]

State = TypeVar("State")


@dataclass(frozen=True)
class Step(Generic[State]):
    """One named step of a load: ``run`` reads and extends the load's state."""

    name: str
    run: Callable[[State], None]
    # The reason an exception that is not already a typed error is reported with.
    failure: Reason = Reason.internal_error


class StepTimes:
    """Milliseconds per step, for the log line that says where the time went."""

    def __init__(self) -> None:
        self.last = time.perf_counter()
        self.times: list[tuple[str, float]] = []

    def done(self, step: str) -> None:
        now = time.perf_counter()
        self.times.append((step, (now - self.last) * 1e3))
        self.last = now

    def __str__(self) -> str:
        return ", ".join(f"{step} {ms:.1f} ms" for step, ms in self.times)


def run_steps(steps: Sequence[Step[State]], state: State) -> StepTimes:
    """Run ``steps`` in order on ``state``; the first failure ends the load, as a typed error."""
    times = StepTimes()
    for step in steps:
        with typed_failures(step.failure):
            step.run(state)
        times.done(step.name)
    return times
