"""An independent restatement of what vLLM 0.33 does to a ModelOpt FP8 linear layer, step by step
in vLLM's own order, used to check ``modelopt_fp8.processing`` byte for byte.

It shares no code with the implementation under test. Each step names the vLLM 0.33.0 source it
restates:

1. weight loaders: ``QKVParallelLinear``/``MergedColumnParallelLinear`` narrow each shard's rows
   to the rank (kv heads replicated past their count), ``RowParallelLinear`` narrows columns;
   per-tensor scales land at their shard index, per-channel scales narrow like the rows.
2. ``KFp8StaticTensor.process`` (``quantization/modelopt.py``) with
   ``w8a8_utils.requantize_with_max_scale``, or ``KFp8StaticChannel.process`` (the same file).
3. ``CutlassFP8ScaledMMLinearKernel.process_weights_after_loading``
   (``kernels/linear/scaled_mm/cutlass.py``).

The CUDA arithmetic of ``per_tensor_dequantize`` and ``static_scaled_fp8_quant`` is restated in
float64 numpy-free torch, rounding explicitly where the GPU rounds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

E4M3_MAX = 448.0


def cuda_per_tensor_dequantize(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # weight.to(float16) * scale on CUDA: the float32 0-dim scale is cast to the float16
    # operand type; the exact product of two halves is rounded once to half.
    a = w.to(torch.float64).to(torch.float16).to(torch.float64)
    b = scale.to(torch.float32).to(torch.float16).to(torch.float64)
    return (a * b).to(torch.float16)


def cuda_static_fp8_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    inv = torch.tensor(1.0 / float(scale), dtype=torch.float64).to(torch.float32)
    y = (x.to(torch.float32).to(torch.float64) * inv.to(torch.float64)).to(torch.float32)
    y = torch.nan_to_num(y, nan=E4M3_MAX, posinf=E4M3_MAX, neginf=-E4M3_MAX)
    return torch.clamp(y, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def load_shard(
    full: torch.Tensor, kind: str, shard_id: str, tp: int, rank: int, num_kv_heads: int
) -> torch.Tensor:
    """Step 1 for one shard weight ``[out, in]``."""
    if kind == "row":
        size = full.shape[1] // tp
        return full.narrow(1, rank * size, size)
    if kind == "qkv" and shard_id in ("k", "v") and tp >= num_kv_heads:
        replicas = tp // num_kv_heads
        size = full.shape[0] // num_kv_heads
        return full.narrow(0, (rank // replicas) * size, size)
    size = full.shape[0] // tp
    return full.narrow(0, rank * size, size)


def vllm_linear(
    ckpt: dict[str, torch.Tensor],
    shard_prefixes: list[tuple[str, str]],
    kind: str,
    algo: str,
    tp: int = 1,
    rank: int = 0,
    num_kv_heads: int = 1,
) -> dict[str, torch.Tensor | int]:
    """The tensors vLLM leaves on the layer: weight ``[K_pad, N_pad]`` view, scales, N."""
    weights, widths = [], []
    for prefix, shard_id in shard_prefixes:
        w = load_shard(ckpt[f"{prefix}.weight"], kind, shard_id, tp, rank, num_kv_heads)
        weights.append(w)
        widths.append(w.shape[0])
    weight = torch.cat(weights).contiguous()  # the fused parameter [N, K]

    out: dict[str, torch.Tensor | int] = {}
    if algo == "FP8":
        weight_scale = torch.stack(
            [ckpt[f"{p}.weight_scale"].reshape(()) for p, _ in shard_prefixes]
        ).to(torch.float32)
        input_scale = torch.stack(
            [ckpt[f"{p}.input_scale"].reshape(()) for p, _ in shard_prefixes]
        ).to(torch.float32)
        max_w_scale = weight_scale.max()
        if not (weight_scale == weight_scale[0]).all():
            start = 0
            for idx, width in enumerate(widths):
                end = start + width
                dq = cuda_per_tensor_dequantize(weight[start:end, :], weight_scale[idx])
                weight[start:end, :] = cuda_static_fp8_quant(dq, max_w_scale)
                start = end
        kn = weight.t()
        out["weight_scale"] = max_w_scale
        out["input_scale"] = input_scale.max()
    else:
        scales = []
        for (prefix, shard_id), width in zip(shard_prefixes, widths, strict=True):
            full = ckpt[f"{prefix}.weight_scale"].reshape(-1)
            if kind == "row":
                scales.append(full)
            else:
                scales.append(
                    load_shard(full[:, None], kind, shard_id, tp, rank, num_kv_heads).reshape(-1)
                )
            assert scales[-1].numel() == width
        kn = weight.t()
        out["weight_scale"] = torch.cat(scales).to(torch.float32)

    biases = [f"{prefix}.bias" for prefix, _ in shard_prefixes]
    if all(b in ckpt for b in biases):  # sliced like the output rows, never padded
        out["bias"] = torch.cat(
            [
                load_shard(ckpt[b][:, None], kind, shard_id, tp, rank, num_kv_heads).reshape(-1)
                for b, (_, shard_id) in zip(biases, shard_prefixes, strict=True)
            ]
        )

    # CUTLASS: remember N, pad K and N to 16 (weight zeros, per-channel scales 1.0).
    out["logical_output_size"] = kn.shape[1]
    pad_k = (16 - kn.shape[0] % 16) % 16
    pad_n = (16 - kn.shape[1] % 16) % 16
    if pad_k or pad_n:
        kn = (
            F.pad(kn.t().contiguous().view(torch.uint8), (0, pad_k, 0, pad_n))
            .view(torch.float8_e4m3fn)
            .t()
        )
        ws = out["weight_scale"]
        assert isinstance(ws, torch.Tensor)
        if pad_n and ws.numel() > 1:
            out["weight_scale"] = F.pad(ws, (0, pad_n), value=1.0)
    out["weight"] = kn
    return out
