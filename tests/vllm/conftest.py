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
