"""Demo checkpoints: deterministic, in the real ModelOpt export format, with what tests need."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.checkpoint_tools import all_tensors
from modelopt_fp8.checkpoint import Checkpoint
from modelopt_fp8.processing.plan import plan_model
from service.demo import SHAPES, write_demo_checkpoint
from tests.conftest import FIXTURES


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path: Path, tiny_fp8: Path) -> None:
    again = write_demo_checkpoint(tmp_path / "a", "fp8", "tiny", seed=0)
    other = write_demo_checkpoint(tmp_path / "b", "fp8", "tiny", seed=1)
    assert (again / "model.safetensors").read_bytes() == (
        tiny_fp8 / "model.safetensors"
    ).read_bytes()
    assert (other / "model.safetensors").read_bytes() != (
        tiny_fp8 / "model.safetensors"
    ).read_bytes()


def _suffix(name: str) -> str:
    parts = name.split(".")
    return ".".join(p if not p.isdigit() else "N" for p in parts)


@pytest.mark.parametrize(
    ("scheme", "export"), [("fp8", "llama-fp8-kv"), ("fp8-pc-pt", "llama-fp8-pc-pt-kv")]
)
def test_matches_the_real_export_format(
    tiny_fp8: Path, tiny_pc: Path, scheme: str, export: str
) -> None:
    demo = tiny_fp8 if scheme == "fp8" else tiny_pc
    real = FIXTURES / "modelopt" / export
    ours, theirs = all_tensors(demo), all_tensors(real)
    kinds = {_suffix(n): (t.dtype, t.dim()) for n, t in ours.items()}
    real_kinds = {_suffix(n): (t.dtype, t.dim()) for n, t in theirs.items()}
    assert kinds == real_kinds
    ours_cfg = json.loads((demo / "config.json").read_text())["quantization_config"]
    real_cfg = json.loads((real / "config.json").read_text())["quantization_config"]
    assert set(ours_cfg) == set(real_cfg) - {"config_groups"}
    ours_hf = json.loads((demo / "hf_quant_config.json").read_text())
    real_hf = json.loads((real / "hf_quant_config.json").read_text())
    assert ours_hf["quantization"] == real_hf["quantization"]


def test_tiny_exercises_requantization_and_padding(tiny_fp8: Path) -> None:
    t = all_tensors(tiny_fp8)
    a = "model.layers.0.self_attn"
    scales = {t[f"{a}.{p}_proj.weight_scale"].item() for p in "qkv"}
    assert len(scales) == 3
    with Checkpoint.open(tiny_fp8) as ckpt:
        gate_up = plan_model(ckpt).layouts[2]
    assert gate_up.output_size % 16 != 0


def test_shapes_are_the_real_architectures() -> None:
    q = SHAPES["qwen2.5-0.5b"].dims
    assert (q.architecture, q.hidden_size, q.intermediate_size, q.num_hidden_layers) == (
        "Qwen2ForCausalLM",
        896,
        4864,
        24,
    )
    assert q.qkv_bias and q.tie_word_embeddings
    llama = SHAPES["llama-8b"].dims
    assert (
        llama.hidden_size,
        llama.intermediate_size,
        llama.num_key_value_heads,
        llama.vocab_size,
    ) == (4096, 14336, 8, 128256)


def test_rejects_unknown_scheme_or_shape(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="scheme"):
        write_demo_checkpoint(tmp_path, "nvfp4", "tiny")
    with pytest.raises(ValueError, match="shape"):
        write_demo_checkpoint(tmp_path, "fp8", "huge")


def test_block_fp8_is_written_as_qwen3_fp8_exports_it(tmp_path: Path) -> None:
    """Every linear weight float8_e4m3fn with one float32 ``weight_scale_inv`` per 128x128
    block (its largest value at FP8's largest), the rest bf16, ``quant_method`` fp8 and no
    ModelOpt file."""
    out = write_demo_checkpoint(tmp_path / "block", "fp8-block", "tiny-128")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
        "activation_scheme": "dynamic",
    }
    assert not (out / "hf_quant_config.json").exists()
    tensors = all_tensors(out)
    weights = {n[: -len(".weight")] for n in tensors if n.endswith("proj.weight")}
    assert weights and not [n for n in tensors if n.endswith(("_scale", "input_scale"))]
    for prefix in weights:
        weight, scale = tensors[f"{prefix}.weight"], tensors[f"{prefix}.weight_scale_inv"]
        n, k = weight.shape
        assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
        assert scale.shape == (-(-n // 128), -(-k // 128))
        blocks = weight.float().view(n // 128, 128, k // 128, 128)
        assert torch.equal(blocks.abs().amax(dim=(1, 3)), torch.full(scale.shape, 448.0))
    others = {n: t for n, t in tensors.items() if not n.endswith(("proj.weight", "_inv"))}
    assert others and {t.dtype for t in others.values()} == {torch.bfloat16}


def test_bf16_has_no_quantization(tmp_path: Path) -> None:
    out = write_demo_checkpoint(tmp_path / "bf16", "bf16", "tiny")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert not (out / "hf_quant_config.json").exists()
    tensors = all_tensors(out)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert not [n for n in tensors if "scale" in n]


def test_block_fp8_refuses_a_shape_vllm_could_not_load(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"q_proj has 64 rows"):
        write_demo_checkpoint(tmp_path / "x", "fp8-block", "tiny")
    assert not (tmp_path / "x").exists()
