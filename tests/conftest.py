"""Shared fixtures: demo checkpoints made once per session, the real ModelOpt exports, and the
``gpu``/``vllm`` markers that skip cleanly where their hardware or environment is absent."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from service.demo import write_demo_checkpoint

FIXTURES = Path(__file__).parent / "fixtures"

# Daemons the tests start (and their `serve` subprocesses) start no keeper unless a test asks,
# and keep their sockets out of the machine's own run directory.
os.environ.setdefault("WEIGHT_CACHE_KEEPER", "off")
os.environ.setdefault("WEIGHT_CACHE_RUN_DIR", tempfile.mkdtemp(prefix="wc-run-"))
MODELOPT_EXPORTS = sorted(p for p in (FIXTURES / "modelopt").iterdir() if p.is_dir())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not torch.cuda.is_available():
        skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def demo_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("demo")


@pytest.fixture(scope="session")
def tiny_fp8(demo_root: Path) -> Path:
    return write_demo_checkpoint(demo_root / "tiny-fp8", "fp8", "tiny")


@pytest.fixture(scope="session")
def tiny_pc(demo_root: Path) -> Path:
    return write_demo_checkpoint(demo_root / "tiny-pc", "fp8-pc-pt", "tiny")


@pytest.fixture(params=["fp8", "fp8-pc-pt"])
def tiny_any(request: pytest.FixtureRequest, tiny_fp8: Path, tiny_pc: Path) -> Path:
    return tiny_fp8 if request.param == "fp8" else tiny_pc


@pytest.fixture
def copy_of(tmp_path: Path):
    """A writable copy of a checkpoint directory, to break in a test."""

    def make(src: Path) -> Path:
        dst = tmp_path / src.name
        shutil.copytree(src, dst)
        return dst

    return make


@pytest.fixture
def daemon_process(tmp_path: Path, tiny_fp8: Path):
    """A real daemon process serving the tiny FP8 demo checkpoint as model ``tiny``."""
    from harness.daemon_process import start_daemon

    daemon = start_daemon(tmp_path, [tiny_fp8], "--model-id", "tiny")
    yield daemon
    daemon.stop()


@pytest.fixture
def held_load(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Every model load in this process waits, once planned, until the returned event is set
    (set at teardown too, so a failing test never leaves a load hanging)."""
    from modelopt_fp8.processing.execute import execute_plan

    gate = threading.Event()

    def held(*args: Any, **kwargs: Any) -> Any:
        gate.wait(30)
        return execute_plan(*args, **kwargs)

    monkeypatch.setattr("service.registry.loader.execute_plan", held)
    yield gate
    gate.set()
