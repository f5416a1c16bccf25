"""Building a vLLM model on the CPU platform from a checkpoint directory (tests only)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from harness.vllm_cpu import cutlass_kernel_on_cpu

__all__ = ["build", "configs", "cutlass_kernel_on_cpu", "vllm_world"]


@contextlib.contextmanager
def vllm_world(tp_size: int = 1, rank: int = 0, port: int = 29600) -> Iterator[None]:
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )

    init_distributed_environment(
        world_size=tp_size,
        rank=rank,
        local_rank=rank,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
        backend="gloo",
    )
    ensure_model_parallel_initialized(tp_size, 1)
    try:
        yield
    finally:
        destroy_model_parallel()
        destroy_distributed_environment()


def configs(
    path: Path,
    load_format: str = "auto",
    extra: dict[str, Any] | None = None,
    tp_size: int = 1,
    kv_cache_dtype: str = "auto",
) -> tuple[Any, Any]:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        LoadConfig,
        ModelConfig,
        ParallelConfig,
        VllmConfig,
    )

    model_config = ModelConfig(
        model=str(path),
        tokenizer=str(path),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=256,
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        load_config=LoadConfig(load_format=load_format, model_loader_extra_config=extra or {}),
        device_config=DeviceConfig(device="cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=tp_size),
        cache_config=CacheConfig(cache_dtype=kv_cache_dtype),
    )
    return vllm_config, model_config


def build(vllm_config: Any, model_config: Any, device: str = "cpu") -> torch.nn.Module:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    with (
        set_current_vllm_config(vllm_config),
        set_default_torch_dtype(model_config.dtype),
        torch.device(device),
    ):
        model: torch.nn.Module = initialize_model(
            vllm_config=vllm_config, model_config=model_config
        )
    return model
