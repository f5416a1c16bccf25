"""Planning refuses every tensor-level defect with a typed error naming file and tensor, and lays
out exactly what vLLM will hold."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.checkpoint_tools import rewrite_json, rewrite_tensors
from modelopt_fp8.checkpoint import Checkpoint
from modelopt_fp8.processing.plan import plan_model
from protocol.errors import (
    InvalidScaleError,
    MissingTensorError,
    TensorDtypeError,
    TensorParallelError,
    TensorShapeError,
    UnsupportedQuantAlgoError,
)

Q = "model.layers.1.self_attn.q_proj"


def test_tiny_layout(tiny_fp8: Path) -> None:
    with Checkpoint.open(tiny_fp8) as ckpt:
        plan = plan_model(ckpt)
    names = [lp.layout.name for lp in plan.linears]
    assert names[:2] == ["model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj"]
    carried = {c.spec.name for c in plan.carried}
    assert {
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.self_attn.attn.k_scale",
        "model.layers.1.self_attn.attn.v_scale",
    } <= carried
    assert not any(n.endswith(("q_proj.weight", "k_proj.k_scale")) for n in carried)
    assert plan.total_bytes == sum(s.nbytes for s in plan.specs)
    qkv = plan.linears[0]
    assert qkv.weight.storage_shape == (128, 64) and qkv.weight.shape == (64, 128)


def test_exclusion_keeps_a_layer_unquantized(tiny_fp8: Path, copy_of) -> None:
    path = copy_of(tiny_fp8)
    mlp = "model.layers.0.mlp"

    def to_bf16(t: dict[str, torch.Tensor]) -> None:
        for proj in ("gate_proj", "up_proj"):
            w = t[f"{mlp}.{proj}.weight"]
            t[f"{mlp}.{proj}.weight"] = w.float().to(torch.bfloat16)
            del t[f"{mlp}.{proj}.weight_scale"], t[f"{mlp}.{proj}.input_scale"]

    rewrite_tensors(path, to_bf16)
    rewrite_json(
        path / "config.json",
        lambda c: c["quantization_config"]["ignore"].append(f"{mlp}.gate_up_proj"),
    )
    (path / "hf_quant_config.json").unlink()
    with Checkpoint.open(path) as ckpt:
        plan = plan_model(ckpt)
    layout = plan.linears[2].layout
    assert layout.scheme == "unquantized" and layout.kernel.value == "none"
    assert plan.linears[2].weight.shape == (168, 64)  # fused [N, K], not transposed or padded


def _broken(path: Path, mutate) -> Path:
    rewrite_tensors(path, mutate)
    return path


@pytest.mark.parametrize(
    ("mutate", "error", "tensor"),
    [
        (lambda t: t.pop(f"{Q}.weight"), MissingTensorError, f"{Q}.weight"),
        (lambda t: t.pop(f"{Q}.weight_scale"), MissingTensorError, f"{Q}.weight_scale"),
        (lambda t: t.pop(f"{Q}.input_scale"), MissingTensorError, f"{Q}.input_scale"),
        (
            lambda t: t.update({f"{Q}.weight": t[f"{Q}.weight"].float().to(torch.bfloat16)}),
            TensorDtypeError,
            f"{Q}.weight",
        ),
        (
            lambda t: t.update({f"{Q}.weight_scale": t[f"{Q}.weight_scale"].double()}),
            TensorDtypeError,
            f"{Q}.weight_scale",
        ),
        (
            lambda t: t.update({f"{Q}.weight": t[f"{Q}.weight"][:, :32].contiguous()}),
            TensorShapeError,
            f"{Q}.weight",
        ),
        (
            lambda t: t.update({f"{Q}.weight_scale": torch.ones(3)}),
            TensorShapeError,
            f"{Q}.weight_scale",
        ),
        (
            lambda t: t.update(
                {"model.embed_tokens.weight": torch.zeros(10, 64, dtype=torch.bfloat16)}
            ),
            TensorShapeError,
            "model.embed_tokens.weight",
        ),
        (
            lambda t: t.pop("model.layers.0.self_attn.k_proj.k_scale"),
            MissingTensorError,
            "model.layers.0.self_attn.k_proj.k_scale",
        ),
        (
            lambda t: t.update(
                {"lm_head.weight": t["lm_head.weight"].float().to(torch.float8_e4m3fn)}
            ),
            UnsupportedQuantAlgoError,
            "lm_head.weight",
        ),
        (
            lambda t: t.update({"stray.weight": torch.zeros(4).to(torch.float8_e4m3fn)}),
            TensorDtypeError,
            "stray.weight",
        ),
    ],
)
def test_tensor_defects_are_refused(tiny_fp8: Path, copy_of, mutate, error, tensor) -> None:
    path = _broken(copy_of(tiny_fp8), mutate)
    # Opening refuses what it can see in the headers (a layer's missing weight); the plan the rest.
    with pytest.raises(error) as err, Checkpoint.open(path) as ckpt:
        plan_model(ckpt)
    assert err.value.extra["tensor"] == tensor


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -0.01])
@pytest.mark.parametrize("which", ["weight_scale", "input_scale"])
def test_bad_scales_are_refused(tiny_fp8: Path, copy_of, value: float, which: str) -> None:
    path = _broken(
        copy_of(tiny_fp8),
        lambda t: t.update({f"{Q}.{which}": torch.tensor(value, dtype=torch.float32)}),
    )
    with Checkpoint.open(path) as ckpt, pytest.raises(InvalidScaleError) as err:
        plan_model(ckpt)
    assert err.value.extra["tensor"] == f"{Q}.{which}"
    assert err.value.extra["file"].endswith("model.safetensors")


def test_bad_per_channel_scale(tiny_pc: Path, copy_of) -> None:
    def poison(t: dict[str, torch.Tensor]) -> None:
        s = t[f"{Q}.weight_scale"].clone()
        s[7] = float("nan")
        t[f"{Q}.weight_scale"] = s

    with (
        Checkpoint.open(_broken(copy_of(tiny_pc), poison)) as ckpt,
        pytest.raises(InvalidScaleError),
    ):
        plan_model(ckpt)


@pytest.mark.parametrize("tp", [3, 8])
def test_tp_sizes_that_do_not_divide(tiny_fp8: Path, tp: int) -> None:
    with Checkpoint.open(tiny_fp8) as ckpt, pytest.raises(TensorParallelError):
        plan_model(ckpt, tp, 0)
