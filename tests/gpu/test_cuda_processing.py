"""On the GPU: the CPU emulation of vLLM's CUDA arithmetic is what CUDA computes, the daemon's
CUDA arenas hold exactly an ordinary load's bytes, and the FP8 forward through
``torch._scaled_mm`` agrees with the CPU emulation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_client.fp8_linear import Fp8LinearWeights, fp8_linear
from modelopt_fp8.checkpoint import Checkpoint
from modelopt_fp8.processing.execute import process_checkpoint
from modelopt_fp8.processing.fp8 import FP8_DTYPE, dequantize_to_fp16, quantize_static
from modelopt_fp8.processing.plan import plan_model
from protocol.devices import Placement
from protocol.schemas.manifest import DeviceKind
from service.registry.loader import LoadRequest, Progress, load_model

pytestmark = pytest.mark.gpu
CODES = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE)


@pytest.mark.parametrize("scale", [0.1, 0.0017102945130318403, 3.7e-4, 0.3, 1.7])
def test_per_tensor_dequantize_rounds_as_the_gpu_does(scale: float) -> None:
    """vLLM runs ``weight.to(float16) * weight_scale[idx]`` on CUDA tensors."""
    s = torch.tensor(scale, dtype=torch.float32)
    on_gpu = (CODES.cuda().to(torch.float16) * s.cuda()).cpu()
    ours = dequantize_to_fp16(CODES, s)
    nan = torch.isnan(ours)
    assert torch.equal(torch.isnan(on_gpu), nan) and int(nan.sum()) == 2  # e4m3 0x7f and 0xff
    # NaN payloads differ between devices and do not matter: requantizing maps NaN to 448.
    assert torch.equal(on_gpu[~nan].view(torch.int16), ours[~nan].view(torch.int16))
    if scale == 0.1:  # CPU torch keeps the scale in float32, which is why CUDA is emulated
        cpu_torch = CODES.to(torch.float16) * s
        assert not torch.equal(cpu_torch[~nan].view(torch.int16), ours[~nan].view(torch.int16))


@pytest.mark.parametrize("scale", [0.7, 0.0031585819087922573, 2.5e-3])
def test_static_quantization_matches_on_gpu(scale: float) -> None:
    x = torch.randn(4096, dtype=torch.float32) * 300
    s = torch.tensor(scale, dtype=torch.float32)
    assert torch.equal(
        quantize_static(x.cuda(), s.cuda()).cpu().view(torch.uint8),
        quantize_static(x, s).view(torch.uint8),
    )


@pytest.mark.parametrize("scheme", ["fp8", "fp8-pc-pt"])
def test_cuda_arena_holds_the_ordinary_load(
    tiny_fp8: Path, tiny_pc: Path, tmp_path: Path, scheme: str
) -> None:
    path = tiny_fp8 if scheme == "fp8" else tiny_pc
    request = LoadRequest.unmanaged("t", path, [Placement(DeviceKind.cuda, 0)])
    (rank,) = load_model(request, Progress())
    try:
        with Checkpoint.open(path) as ckpt:
            plan = plan_model(ckpt)
            expected = process_checkpoint(ckpt, plan)
        specs = {s.name: s for s in plan.specs}
        for entry in rank.manifest.tensors:
            spec = specs[entry.name]
            stored = rank.arena.storage(spec).cpu()
            want = spec.storage_of(expected[entry.name])
            assert torch.equal(
                stored.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)
            ), entry.name
    finally:
        rank.arena.release()


def test_scaled_mm_on_gpu_matches_the_emulation(tiny_any: Path) -> None:
    """Every layer: ``torch._scaled_mm`` on the GPU and the CPU emulation agree to within 1%
    (relative norm); they differ only in the order of the float32 accumulation."""
    with Checkpoint.open(tiny_any) as ckpt:
        plan = plan_model(ckpt)
        cpu = process_checkpoint(ckpt, plan)
        gpu = process_checkpoint(ckpt, plan, "cuda")
    assert len(plan.layouts) == 8
    for layout in plan.layouts:
        x = (torch.randn(16, layout.input_size) * 0.5).to(torch.bfloat16)
        y_gpu = fp8_linear(x.cuda(), Fp8LinearWeights.from_tensors(layout, gpu)).float().cpu()
        y_cpu = fp8_linear(x, Fp8LinearWeights.from_tensors(layout, cpu)).float()
        assert y_gpu.shape == (16, layout.output_size), layout.name
        assert ((y_gpu - y_cpu).norm() / y_cpu.norm()) < 1e-2, layout.name
