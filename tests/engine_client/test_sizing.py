"""The shared sizing rule: N engines' budgets, the daemon's memory, each engine's memory outside
its budget and the spare add up to the GPU; one engine alone takes what is left; engines that
cannot fit are refused."""

from __future__ import annotations

import math

import pytest

from engine_client.sizing import OUTSIDE_BUDGET_BYTES, SPARE_BYTES, shared_utilization

GIB = 1 << 30
H100 = 79 * GIB + 200 * (1 << 20)


@pytest.mark.parametrize("engines", [1, 2, 4, 8])
def test_the_engines_give_the_gpu_away_with_the_weights_counted_once(engines: int) -> None:
    daemon, weights = int(9.12 * GIB), int(8.46 * GIB)
    figure = shared_utilization(H100, daemon, weights, engines)
    assert figure.engine_budget_bytes == math.ceil(H100 * figure.utilization) - weights
    used = daemon + engines * (figure.engine_budget_bytes + OUTSIDE_BUDGET_BYTES) + SPARE_BYTES
    assert H100 - engines * H100 // 10_000 - engines <= used <= H100  # rounded down, 1e-4 each


def test_engines_that_cannot_fit_are_refused() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        shared_utilization(10 * GIB, 9 * GIB, 8 * GIB, 8)
    with pytest.raises(ValueError):
        shared_utilization(H100, GIB, GIB, 0)
