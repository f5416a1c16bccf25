"""The demo writer's formats the daemon does not process, read by vLLM 0.33 itself: block FP8
as Qwen3-FP8 exports it becomes vLLM's ``Fp8Config`` with 128x128 blocks and every tensor is
what vLLM's block-FP8 layer makes for it; bf16 is unquantized.

vLLM 0.33's CPU platform builds no block-FP8 layer here: its two CPU kernels need AMX tiles (and
the CPU build's own ops, absent from the CUDA build these tests run), so block FP8 is donated
and attached on a GPU only; the last test says so, and fails where that changes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.checkpoint_tools import all_tensors
from harness.daemon_process import free_port
from service.demo import write_demo_checkpoint
from tests.vllm.vllm_model import build, configs, vllm_world


@pytest.fixture(scope="module")
def block_fp8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("block") / "c", "fp8-block", "tiny-128")


def test_vllm_reads_block_fp8_as_its_fp8_config_with_blocks(block_fp8: Path) -> None:
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    vllm_config, model_config = configs(block_fp8)
    assert model_config.quantization == "fp8"
    quant = vllm_config.quant_config
    assert isinstance(quant, Fp8Config)
    assert quant.is_checkpoint_fp8_serialized
    assert quant.weight_block_size == [128, 128]
    assert quant.activation_scheme == "dynamic"


def test_every_tensor_is_what_vllms_block_fp8_layer_makes_for_it(block_fp8: Path) -> None:
    """Each shard's weight and ``weight_scale_inv`` have the dtype and shape of the parameters
    vLLM's block-FP8 method creates for a layer of that shard's size."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.quantization.utils.fp8_utils import (
        create_fp8_scale_parameter,
        create_fp8_weight_parameter,
    )
    from vllm.model_executor.parameter import BlockQuantScaleParameter

    vllm_config, _ = configs(block_fp8)
    block = vllm_config.quant_config.weight_block_size
    tensors = all_tensors(block_fp8)
    weights = [n for n in tensors if n.endswith("proj.weight")]
    assert weights
    with set_current_vllm_config(vllm_config), vllm_world(1, 0, free_port()):
        for name in weights:
            n, k = tensors[name].shape
            weight = create_fp8_weight_parameter(n, k, None)
            scale = create_fp8_scale_parameter(BlockQuantScaleParameter, [n], k, block, None)
            written = tensors[name.replace(".weight", ".weight_scale_inv")]
            assert (tensors[name].dtype, tensors[name].shape) == (weight.dtype, weight.shape)
            assert (written.dtype, written.shape) == (scale.dtype, scale.shape), name


def test_vllm_reads_bf16_as_unquantized(tmp_path: Path) -> None:
    vllm_config, model_config = configs(write_demo_checkpoint(tmp_path / "bf16", "bf16", "tiny"))
    assert model_config.quantization is None and vllm_config.quant_config is None
    assert model_config.dtype == torch.bfloat16


def test_the_cpu_platform_builds_no_block_fp8_layer_here(block_fp8: Path) -> None:
    from vllm.config import set_current_vllm_config

    vllm_config, model_config = configs(block_fp8)
    with (
        set_current_vllm_config(vllm_config),
        vllm_world(1, 0, free_port()),
        pytest.raises(ValueError, match="Failed to find a kernel") as refused,
    ):
        build(vllm_config, model_config, device="meta")
    assert "CPUFp8BlockScaledMMKernel requires AMX" in str(refused.value)
