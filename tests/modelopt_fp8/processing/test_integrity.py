"""Data integrity at load: non-finite values and e4m3 NaN codes in a checkpoint are refused,
naming the tensor, before anything is served."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.checkpoint_tools import rewrite_tensors
from modelopt_fp8.checkpoint import Checkpoint
from modelopt_fp8.processing.execute import process_checkpoint
from modelopt_fp8.processing.plan import plan_model
from protocol.errors import CorruptFileError


@pytest.mark.parametrize(
    ("tensor", "value"),
    [
        ("model.embed_tokens.weight", float("nan")),
        ("model.embed_tokens.weight", float("inf")),
        ("model.norm.weight", float("-inf")),
        ("model.layers.1.self_attn.q_proj.weight", 0x7F),  # an e4m3 NaN code
        ("model.layers.0.mlp.down_proj.weight", 0xFF),
    ],
)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_corrupt_data_is_refused_at_load(
    copy_of, tiny_pc: Path, tensor: str, value: float, device: str
) -> None:
    """On the host the loading threads check the bytes they read; on a GPU the GPU does."""
    path = copy_of(tiny_pc)

    def corrupt(tensors: dict[str, torch.Tensor]) -> None:
        target = tensors[tensor].clone()
        if target.dtype == torch.float8_e4m3fn:
            target.view(torch.uint8).reshape(-1)[7] = int(value)
        else:
            target.reshape(-1)[7] = value
        tensors[tensor] = target

    rewrite_tensors(path, corrupt)
    with Checkpoint.open(path) as ckpt, pytest.raises(CorruptFileError) as err:
        process_checkpoint(ckpt, plan_model(ckpt), device)
    assert err.value.extra["tensor"] == tensor
