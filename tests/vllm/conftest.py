"""Tests against the real vLLM 0.33 (run in its own environment: ``make test`` uses
``$(VLLM_VENV)``). vLLM's CUDA build selects its CPU platform here, which is enough to build
models, run its weight loaders and TP sharding on gloo; see the README for what needs a GPU."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
vllm = pytest.importorskip("vllm")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.vllm)


@pytest.fixture(autouse=True)
def fresh_rotary_cache():
    """vLLM caches rotary embeddings per process; tests that build on the meta device must not
    hand their meta caches to the next test's model."""
    from vllm.model_executor.layers import rotary_embedding

    rotary_embedding._ROPE_DICT.clear()
    yield
    rotary_embedding._ROPE_DICT.clear()
