"""What ``engine_client.vllm.startup`` relies on in vLLM 0.33's worker, engine core and front
end. Each test fails on the vLLM version where its fact stops holding."""

from __future__ import annotations

import inspect

import pytest

GiB = 1 << 30


def _in_order(source: str, *needles: str) -> None:
    positions = [source.find(n) for n in needles]
    assert -1 not in positions, [n for n, p in zip(needles, positions, strict=True) if p < 0]
    assert positions == sorted(positions), dict(zip(needles, positions, strict=True))


def test_the_worker_asks_the_loader_just_before_its_memory_snapshot() -> None:
    """Parking inside ``get_external_weight_memory`` waits after the CUDA context (and NCCL)
    exist and before the snapshot ``gpu_memory_utilization`` is checked against."""
    from vllm.v1.worker.gpu_worker import Worker

    _in_order(
        inspect.getsource(Worker.init_device),
        "init_worker_distributed_environment(",
        ".get_external_weight_memory(",
        "MemorySnapshot(",
        "request_memory(",
        "_init_workspace_and_model_runner()",
    )


def test_the_snapshot_must_show_the_engines_budget_free() -> None:
    """What a standby parked before the snapshot would meet while the serving engine holds its
    KV cache: the start-up check refuses it."""
    from vllm.config import CacheConfig
    from vllm.utils.mem_utils import MemorySnapshot
    from vllm.v1.worker.utils import request_memory

    cache = CacheConfig(gpu_memory_utilization=0.5)
    busy = MemorySnapshot(device="cpu", auto_measure=False, free_memory=10 * GiB)
    busy.total_memory = 100 * GiB
    with pytest.raises(ValueError, match="less than the engine's budget"):
        request_memory(busy, cache, external_weight_memory=8 * GiB)
    freed = MemorySnapshot(device="cpu", auto_measure=False, free_memory=60 * GiB)
    freed.total_memory = 100 * GiB
    assert request_memory(freed, cache, external_weight_memory=8 * GiB) == 42 * GiB


def test_profiling_asserts_free_memory_did_not_grow_since_the_snapshot() -> None:
    """A snapshot taken before the serving engine freed its memory fails this once it has."""
    from vllm.v1.worker.gpu_worker import Worker

    assert "init_free_memory >= free_gpu_memory" in inspect.getsource(
        Worker.determine_available_memory
    )


def test_the_kv_cache_is_allocated_before_the_warm_up_that_ends_start_up() -> None:
    """The start-up slot is given back when the worker's ``compile_or_warm_up_model`` returns:
    after profiling, the KV cache's allocation, and graph capture."""
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.gpu_worker import Worker

    _in_order(
        inspect.getsource(EngineCore._initialize_kv_caches),
        "determine_available_memory()",
        "initialize_from_config(",
        "compile_or_warm_up_model()",
    )
    assert "initialize_kv_cache(" in inspect.getsource(Worker.initialize_from_config)
    assert "capture_model()" in inspect.getsource(Worker._compile_or_warm_up_model)


def test_the_front_end_waits_for_engines_it_starts_without_a_time_limit() -> None:
    """``vllm serve`` (one API server) waits for the engine core's READY for as long as the
    engine process lives; VLLM_ENGINE_READY_TIMEOUT_S (600 s by default) bounds the wait of a
    front end for engines it does not start itself."""
    from vllm import envs
    from vllm.v1.engine import core_client
    from vllm.v1.engine.utils import wait_for_engine_startup

    assert "timeout" not in inspect.signature(wait_for_engine_startup).parameters
    source = inspect.getsource(wait_for_engine_startup)
    assert "poller.poll(STARTUP_POLL_PERIOD_MS)" in source and "continue" in source
    assert envs.VLLM_ENGINE_READY_TIMEOUT_S == 600
    assert "VLLM_ENGINE_READY_TIMEOUT_S * 1000" in inspect.getsource(core_client)


def test_the_workers_wait_for_each_other_without_a_time_limit() -> None:
    """At TP > 1 the executor waits for its workers' READY (after their load) unbounded."""
    from vllm.v1.executor.multiproc_executor import WorkerProc

    source = inspect.getsource(WorkerProc.wait_for_ready)
    assert "multiprocessing.connection.wait(pipes.keys())" in source


def test_after_warm_up_wraps_the_workers_method_once_and_runs_even_on_failure() -> None:
    from vllm.v1.worker.gpu_worker import Worker

    from engine_client.vllm.internals import after_warm_up

    original = Worker.compile_or_warm_up_model
    calls: list[int] = []
    try:
        after_warm_up(lambda: calls.append(1))
        after_warm_up(lambda: calls.append(2))
        wrapped = Worker.compile_or_warm_up_model
        assert wrapped._weight_cache_wraps is original  # wrapped once, around vLLM's own
        with pytest.raises(AttributeError):
            wrapped(object())  # vLLM's warm-up fails (no worker here): the slot goes back still
        assert calls == [1, 2]
        after_warm_up(lambda: calls.append(3))
        assert Worker.compile_or_warm_up_model is wrapped  # not wrapped twice
    finally:
        Worker.compile_or_warm_up_model = original


def test_a_donor_counts_the_weights_it_gave_as_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """While an engine sizes its KV cache it sees its own use alone; a donor's own use includes
    the weights the daemon holds for it since its donation (else its KV cache would take the
    budget its weights had under vLLM's default loader). The driver's silence stays silence."""
    from engine_client.vllm import startup

    monkeypatch.setattr(startup, "bytes_donated_here", lambda: 3 * GiB)
    assert startup.counted_as_own(lambda: 2 * GiB)() == 5 * GiB
    assert startup.counted_as_own(lambda: None)() is None
