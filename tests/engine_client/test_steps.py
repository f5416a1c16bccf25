"""A load as named steps: run in order, timed by name, and a failure in one is one typed error
with that step's reason (the vLLM loader's steps are ``LOAD_STEPS``; this runner has no vLLM)."""

from __future__ import annotations

import pytest

from engine_client.vllm.steps import Step, run_steps
from protocol.errors import AttachError, ModelNotFoundError
from protocol.reasons import Reason


def _appending(name: str) -> Step[list[str]]:
    return Step(name, lambda done: done.append(name))


def test_steps_run_in_order_and_are_timed_by_name() -> None:
    done: list[str] = []
    steps = [_appending(name) for name in ("a", "b", "c")]
    times = run_steps(steps, done)
    assert done == ["a", "b", "c"]
    assert [name for name, _ in times.times] == ["a", "b", "c"]
    assert str(times).startswith("a ") and ", b " in str(times)


def _raise(exc: Exception) -> None:
    raise exc


def test_an_untyped_failure_takes_its_steps_reason_and_stops_the_load() -> None:
    done: list[str] = []
    steps = [
        Step[list[str]]("bind", lambda s: _raise(IndexError("row 7")), Reason.bind_failed),
        Step[list[str]]("after", lambda s: s.append("after")),
    ]
    with pytest.raises(AttachError) as err:
        run_steps(steps, done)
    assert err.value.reason is Reason.bind_failed
    assert isinstance(err.value.__cause__, IndexError)
    assert done == []


def test_a_typed_failure_keeps_its_own_reason() -> None:
    missing = ModelNotFoundError("none")
    steps = [Step[None]("find model", lambda s: _raise(missing), Reason.bind_failed)]
    with pytest.raises(ModelNotFoundError) as err:
        run_steps(steps, None)
    assert err.value is missing
