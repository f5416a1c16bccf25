"""Processing is byte-identical to vLLM 0.33's, on real ModelOpt exports and demo checkpoints,
at TP sizes 1, 2 and 4; and processing then GEMM matches the dequantized reference."""

from __future__ import annotations

from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from engine_client.fp8_linear import Fp8LinearWeights, fp8_linear
from harness.checkpoint_tools import all_tensors, rewrite_tensors
from harness.plain_processing import process_layer
from modelopt_fp8.checkpoint import Checkpoint
from modelopt_fp8.checkpoint.architecture import linear_specs
from modelopt_fp8.processing.execute import process_checkpoint
from modelopt_fp8.processing.fp8 import FP8_DTYPE
from modelopt_fp8.processing.plan import plan_model
from modelopt_fp8.schemes import LinearScheme, fp8, fp8_pc_pt
from modelopt_fp8.schemes.base import FusedLayer, LaidOut, ShardScales
from tests.conftest import MODELOPT_EXPORTS
from tests.vllm_reference import vllm_linear


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).reshape(-1).tolist()) if t.numel() else b""


def assert_identical_to_vllm(path: Path, tp: int, rank: int) -> None:
    with Checkpoint.open(path) as ckpt:
        plan = plan_model(ckpt, tp, rank)
        ours = process_checkpoint(ckpt, plan)
        full = all_tensors(path)
        kinds = {"qkv": "qkv", "merged_column": "merged", "row": "row"}
        for spec, layout in zip(linear_specs(ckpt.dims), plan.layouts, strict=True):
            ref = vllm_linear(
                full,
                [(s.checkpoint_prefix, s.shard_id) for s in spec.shards],
                kinds[spec.parallelism.value],
                ckpt.quant.quant_algo,
                tp,
                rank,
                ckpt.dims.num_key_value_heads,
            )
            w = ours[layout.weight]
            ref_w = ref["weight"]
            assert isinstance(ref_w, torch.Tensor)
            assert w.shape == ref_w.shape and w.stride() == ref_w.stride(), layout.name
            assert torch.equal(w.view(torch.uint8), ref_w.view(torch.uint8)), layout.name
            assert layout.output_size == ref["logical_output_size"]
            assert layout.processed_weight_dims == (0, 1)
            if layout.bias is not None or "bias" in ref:
                ref_bias = ref["bias"]
                assert isinstance(ref_bias, torch.Tensor) and layout.bias is not None
                assert torch.equal(ours[layout.bias], ref_bias), layout.name
            for name in ("weight_scale", "input_scale"):
                ours_t = ours.get(getattr(layout, name) or "")
                ref_t = ref.get(name)
                assert (ours_t is None) == (ref_t is None), (layout.name, name)
                if isinstance(ref_t, torch.Tensor) and ours_t is not None:
                    assert ours_t.shape == ref_t.shape and ours_t.dtype == torch.float32
                    assert torch.equal(ours_t, ref_t), (layout.name, name)


@pytest.mark.parametrize("export", MODELOPT_EXPORTS, ids=lambda p: p.name)
@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 1), (4, 2)])
def test_real_modelopt_exports_match_vllm(export: Path, tp: int, rank: int) -> None:
    assert_identical_to_vllm(export, tp, rank)


@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 0), (2, 1), (4, 0), (4, 3)])
def test_demo_checkpoints_match_vllm(tiny_any: Path, tp: int, rank: int) -> None:
    assert_identical_to_vllm(tiny_any, tp, rank)


def test_hand_computed_unequal_qkv_scales(tiny_fp8: Path, copy_of) -> None:
    """q at scale 0.3 holding 1.75 requantizes to 0.75 under the max scale 0.7:
    fp16(1.75 * fp16(0.3)) = 0.52490234375, x * fp32(1/0.7) = 0.74986 -> e4m3 0.75.
    k (-0.5 at 0.7) and v (2.0 at 0.7) survive the round trip unchanged."""
    path = copy_of(tiny_fp8)
    a = "model.layers.0.self_attn"

    def set_qkv(t: dict[str, torch.Tensor]) -> None:
        for proj, value, scale in (("q", 1.75, 0.3), ("k", -0.5, 0.7), ("v", 2.0, 0.7)):
            w = t[f"{a}.{proj}_proj.weight"]
            t[f"{a}.{proj}_proj.weight"] = torch.full(w.shape, value).to(FP8_DTYPE)
            t[f"{a}.{proj}_proj.weight_scale"] = torch.tensor(scale, dtype=torch.float32)
            t[f"{a}.{proj}_proj.input_scale"] = torch.tensor(
                {"q": 0.02, "k": 0.03, "v": 0.01}[proj], dtype=torch.float32
            )

    rewrite_tensors(path, set_qkv)
    with Checkpoint.open(path) as ckpt:
        plan = plan_model(ckpt)
        out = process_checkpoint(ckpt, plan)
    layout = plan.layouts[0]
    assert layout.logical_widths == [64, 32, 32]
    w = out[layout.weight].float()  # [K_pad, N_pad] view
    assert w.shape == (64, 128) and out[layout.weight].stride() == (1, 64)
    assert torch.all(w[:, :64] == 0.75)
    assert torch.all(w[:, 64:96] == -0.5)
    assert torch.all(w[:, 96:] == 2.0)
    assert out[layout.weight_scale or ""].item() == pytest.approx(0.7)
    assert out[layout.weight_scale or ""].shape == ()
    assert out[layout.input_scale or ""].item() == pytest.approx(0.03)


def test_hand_computed_padding(tiny_pc: Path) -> None:
    """gate_up: N = 2 * 84 = 168 pads to 176 (scales padded with 1.0, weight with zeros);
    down: K = 84 pads to 96 with zero columns."""
    with Checkpoint.open(tiny_pc) as ckpt:
        plan = plan_model(ckpt)
        out = process_checkpoint(ckpt, plan)
        gate = ckpt.read("model.layers.0.mlp.gate_proj.weight")
        up_scale = ckpt.read("model.layers.0.mlp.up_proj.weight_scale")
    gate_up = plan.layouts[2]
    assert (gate_up.output_size, gate_up.padded_output_size) == (168, 176)
    w = out[gate_up.weight]
    assert w.shape == (64, 176) and w.stride() == (1, 64)
    assert torch.equal(w[:, :84].t().contiguous().view(torch.uint8), gate.view(torch.uint8))
    assert torch.all(w[:, 168:].float() == 0)
    scale = out[gate_up.weight_scale or ""]
    assert scale.shape == (176,)
    assert torch.equal(scale[84:168], up_scale)
    assert torch.all(scale[168:] == 1.0)

    down = plan.layouts[3]
    assert (down.input_size, down.padded_input_size) == (84, 96)
    wd = out[down.weight]
    assert wd.shape == (96, 64) and wd.stride() == (1, 96)
    assert torch.all(wd[84:].float() == 0)


def test_hand_computed_tp_split(tiny_fp8: Path) -> None:
    """tiny has 4 heads and 2 kv heads of 16: at TP 4 each rank holds one q head and the kv head
    r // 2; down_proj's K = 84 splits into 21 columns per rank (padded to 32)."""
    full = all_tensors(tiny_fp8)
    with Checkpoint.open(tiny_fp8) as ckpt:
        for rank in range(4):
            plan = plan_model(ckpt, 4, rank)
            qkv, down = plan.layouts[0], plan.layouts[3]
            assert qkv.logical_widths == [16, 16, 16]
            assert (down.input_size, down.padded_input_size) == (21, 32)
            out = process_checkpoint(ckpt, plan)
            k_rows = out[qkv.weight][:, 16:32].t().float()
            a = "model.layers.0.self_attn"
            head = rank // 2
            # requantized to the max scale, so compare dequantized values within one e4m3 step
            ref = (
                full[f"{a}.k_proj.weight"][head * 16 : (head + 1) * 16].float()
                * full[f"{a}.k_proj.weight_scale"]
            )
            got = k_rows * out[qkv.weight_scale or ""]
            assert torch.allclose(got, ref, rtol=0.13, atol=1e-6)


def _views(laid: LaidOut, storages: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    specs = [s for s in (laid.weight, laid.weight_scale, laid.input_scale) if s is not None]
    return {spec.name: spec.view(storages[spec.name]) for spec in specs}


@settings(max_examples=60, deadline=None)
@given(
    scheme=st.sampled_from([fp8.SCHEME, fp8_pc_pt.SCHEME]),
    widths=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    k=st.integers(1, 70),
    m=st.integers(1, 5),
    seed=st.integers(0, 2**31 - 1),
)
def test_processing_then_gemm_matches_dequantized_reference(
    scheme: LinearScheme, widths: list[int], k: int, m: int, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    per_tensor = scheme is fp8.SCHEME  # else one scale per output row
    weights: list[torch.Tensor] = []
    shards: list[ShardScales] = []
    deq: list[torch.Tensor] = []
    input_scale = torch.tensor(0.01 + 0.05 * float(torch.rand((), generator=g)))
    for rows in widths:
        q = (torch.randn(rows, k, generator=g) * 100).clamp(-448, 448).to(FP8_DTYPE)
        if per_tensor:
            scale = (torch.rand((), generator=g) * 0.01 + 1e-4).to(torch.float32)
            deq.append(q.float() * scale)
        else:
            scale = (torch.rand(rows, generator=g) * 0.01 + 1e-4).to(torch.float32)
            deq.append(q.float() * scale[:, None])
        weights.append(q)
        shards.append(ShardScales(scale, input_scale, (0, rows)))
    names = ("s",) * len(widths)
    laid = scheme.lay_out(
        FusedLayer("l", tuple(widths), k, FP8_DTYPE, str(scheme.quant_algo), names, None)
    )
    out = process_layer(scheme, laid, weights, shards)
    layout = laid.layout
    layer = Fp8LinearWeights.from_tensors(layout, _views(laid, out))

    x = (torch.randn(m, k, generator=g) * 0.5).to(torch.bfloat16)
    y = fp8_linear(x, layer).float()
    ref = x.float() @ torch.cat(deq).t()
    # e4m3 carries 3 mantissa bits: activation and (re)quantized weight each err by <= 1/16,
    # so the sum of m products is within 2^-3 of |x| @ |W| relative.
    bound = (x.float().abs() @ torch.cat(deq).abs().t()) * 0.13 + 1e-3
    assert y.shape == (m, layout.output_size)
    assert torch.all((y - ref).abs() <= bound)
