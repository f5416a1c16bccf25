"""Tests against the real vLLM 0.33 (run in its own environment: ``make test`` uses
``$(VLLM_VENV)``). vLLM's CUDA build selects its CPU platform here, which is enough to build
models, run its weight loaders and TP sharding on gloo; see the README ("What needs a GPU").

Every process these tests run sees a plain AVX2 x86-64 host (``cpu_capabilities``); a test that
needs a capability of the host itself says so with ``@pytest.mark.host_capability(...)``."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "could not import 'vllm': the vLLM tests run in its own environment (make test-vllm)",
        allow_module_level=True,
    )

from tests.vllm import cpu_capabilities

# Done at interpreter start under `make test-vllm` (PYTHONPATH=tests/vllm/startup). Without it
# this pins the rest before vLLM is imported and for every process started from here, but torch
# has already chosen its kernels (test_cpu_capabilities says so).
cpu_capabilities.install()
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
vllm = pytest.importorskip("vllm")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.vllm)


@pytest.fixture(autouse=True)
def host_capability(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test marked ``host_capability(*names)`` runs with the host's own answers for those
    capabilities, and is skipped where the host lacks one."""
    marker = request.node.get_closest_marker("host_capability")
    if marker is None:
        yield
        return
    view = cpu_capabilities.current_view().asking_host(*marker.args)
    missing = [name for name in marker.args if not cpu_capabilities.host_has(name)]
    if missing:
        pytest.skip(f"this host's CPU lacks {', '.join(missing)}")
    with cpu_capabilities.viewing(view):
        yield


@pytest.fixture(autouse=True)
def fresh_rotary_cache():
    """vLLM caches rotary embeddings per process; tests that build on the meta device must not
    hand their meta caches to the next test's model."""
    from vllm.model_executor.layers import rotary_embedding

    rotary_embedding._ROPE_DICT.clear()
    yield
    rotary_embedding._ROPE_DICT.clear()
