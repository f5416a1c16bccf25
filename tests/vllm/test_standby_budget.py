"""A warm standby started beside an engine that holds most of the GPU lowers its
``gpu_memory_utilization`` to what is free, so vLLM's ``request_memory`` (which refuses a budget
larger than the free memory) lets it start; an engine that fits, one sized with
``--kv-cache-memory`` and one that is no standby are left as they are."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from engine_client.vllm.startup import STANDBY_SPARE_BYTES, fit_standby_budget

GIB = 1 << 30
TOTAL = 80 * GIB
WEIGHTS = 9 * GIB


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    state = {"free": 12 * GIB}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (state["free"], TOTAL))
    return state


def cache(utilization: float, kv_bytes: int | None = None) -> Any:
    return SimpleNamespace(gpu_memory_utilization=utilization, kv_cache_memory_bytes=kv_bytes)


def test_a_standby_that_does_not_fit_is_fitted_into_the_free_memory(gpu: dict[str, int]) -> None:
    config = cache(0.85)
    fit_standby_budget(config, WEIGHTS, standby=True)
    budget = math.ceil(TOTAL * config.gpu_memory_utilization) - WEIGHTS
    assert budget <= gpu["free"] - STANDBY_SPARE_BYTES  # vLLM's request_memory accepts it
    assert budget > gpu["free"] - STANDBY_SPARE_BYTES - TOTAL // 10_000 - 1  # and no less


def test_others_are_left_as_they_are(gpu: dict[str, int]) -> None:
    for config, standby in ((cache(0.85), False), (cache(0.85, 4 * GIB), True)):
        fit_standby_budget(config, WEIGHTS, standby=standby)
        assert config.gpu_memory_utilization == 0.85
    gpu["free"] = 70 * GIB
    fits = cache(0.85)
    fit_standby_budget(fits, WEIGHTS, standby=True)
    assert fits.gpu_memory_utilization == 0.85
    gpu["free"] = STANDBY_SPARE_BYTES // 2  # no room at all: vLLM's own refusal says so
    full = cache(0.85)
    fit_standby_budget(full, WEIGHTS, standby=True)
    assert full.gpu_memory_utilization == 0.85
