"""vLLM 0.33's CUDA wheel on vLLM's CPU platform (``VLLM_TARGET_DEVICE=cpu``), for the tests and
the demo engine on a machine without a GPU.

The CUDA wheel ships no CPU build of vLLM's custom ops (``vllm._C`` does not even import without
CUDA), so an engine on the CPU platform stops at the first one it calls. :func:`provide_cpu_ops`
gives the few that a dense decoder's engine calls there, restated in plain torch: the worker's
memory-node setup (nothing to do), the CPU attention backend's three calls (paged KV cache,
causal attention), and the FP8 pair the CUTLASS kernel uses (static quantization exactly as the
CUDA op does it: ``modelopt_fp8.processing.fp8``, and the scaled GEMM in float32).
:func:`cutlass_kernel_on_cpu` has the CPU platform pick the CUTLASS FP8 kernel, the one the daemon
processes for, as it does on Hopper. :func:`time_model_loads` times the span the GPU runner logs
as "Model loading took". Every touch of vLLM's internals for this is here, and
``tests/vllm/test_vllm_cpu.py`` holds a test per touch that fails on a vLLM where it stops
holding. Slow, and only as exact as plain torch on this CPU.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch

from modelopt_fp8.processing.fp8 import FP8_MAX, quantize_per_token, quantize_static

# Called straight on ``torch.ops._C``, by their schemas: the worker's memory setup
# (``CPUWorker.__init__``), the block table's slot mapping (``vllm.utils.cpu_triton_utils``), the
# activation fused with FP8 quantization (``vllm.model_executor.layers.fusion.fused_act_quant``)
# and the sampler's greedy pick (``Sampler.greedy_sample``).
TORCH_OPS = {
    "init_cpu_memory_env": "init_cpu_memory_env(int[] nodes) -> ()",
    "compute_slot_mapping_kernel_impl": "compute_slot_mapping_kernel_impl(Tensor query_start_loc, "
    "Tensor positions, Tensor block_table, Tensor(a!) slot_mapping, int block_size) -> ()",
    "silu_and_mul_quant": "silu_and_mul_quant(Tensor(a!) result, Tensor input, Tensor scale) -> ()",
    "greedy_argmax": "greedy_argmax(Tensor logits) -> Tensor",
}

_LIBRARIES: list[torch.library.Library] = []  # the ops registered, kept for the process


def _init_cpu_memory_env(nodes: list[int]) -> None:
    """Binds a CPU build's allocator to NUMA nodes; plain torch allocates as it always does."""


def _compute_slot_mapping(
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
) -> None:
    """Each scheduled token's KV-cache slot, from its request's block table and its position;
    the slots past the last token are padding (-1)."""
    starts = query_start_loc.tolist()
    for r in range(len(starts) - 1):
        where = positions[starts[r] : starts[r + 1]].to(torch.long)
        blocks = block_table[r].to(torch.long)[where // block_size]
        slot_mapping[starts[r] : starts[r + 1]] = blocks * block_size + where % block_size
    slot_mapping[starts[-1] :] = -1


def _silu_and_mul_quant(result: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> None:
    """``silu(gate) * up`` in float32, quantized to the next layer's static input scale (the
    activation fused with the down projection's input quantization)."""
    gate, up = x.float().chunk(2, dim=-1)
    result.copy_(quantize_static(torch.nn.functional.silu(gate) * up, scale))


def _greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The sampler's greedy pick on the CPU platform: each row's first largest logit."""
    return logits.argmax(dim=-1).view(-1)


def _scheduler_metadata(*args: object, **kwargs: object) -> torch.Tensor:
    """The CPU kernels' work split; the attention below needs none."""
    return torch.empty(0, dtype=torch.int32)


def _reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *args: object,
    **kwargs: object,
) -> None:
    """Each token's key and value into its slot: block ``slot // block_size``, row
    ``slot % block_size`` of a ``[blocks, kv_heads, block_size, head_size]`` cache."""
    block_size = key_cache.shape[2]
    slots = slot_mapping.to(torch.long)
    kept = slots >= 0  # a padded token has no slot
    slots = slots[kept]
    blocks, rows = slots // block_size, slots % block_size
    key_cache[blocks, :, rows] = key[: kept.numel()][kept].to(key_cache.dtype)
    value_cache[blocks, :, rows] = value[: kept.numel()][kept].to(value_cache.dtype)


def _attention_with_kv_cache(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    causal: bool,
    alibi_slopes: torch.Tensor | None,
    sliding_window: int,
    block_table: torch.Tensor,
    softcap: float,
    *args: object,
    **kwargs: object,
) -> None:
    """Each request's queries against its cached keys and values (the last of its ``seq_len``
    positions are the queries'), causal, in float32. No ALiBi, window or soft cap: a model
    that needs them is refused rather than answered wrongly."""
    if alibi_slopes is not None or sliding_window > 0 or softcap > 0:
        raise NotImplementedError("ALiBi, sliding windows and soft caps are not restated on CPU")
    block_size = key_cache.shape[2]
    heads, kv_heads = query.shape[1], key_cache.shape[1]
    starts = query_start_loc.tolist()
    for r, seq_len in enumerate(seq_lens.tolist()):
        first, last = starts[r], starts[r + 1]
        if last == first:
            continue
        blocks = block_table[r, : -(-seq_len // block_size)].to(torch.long)
        keys = key_cache[blocks].transpose(0, 1).reshape(kv_heads, -1, key_cache.shape[3])
        values = value_cache[blocks].transpose(0, 1).reshape(kv_heads, -1, value_cache.shape[3])
        keys = keys[:, :seq_len].repeat_interleave(heads // kv_heads, 0).float()
        values = values[:, :seq_len].repeat_interleave(heads // kv_heads, 0).float()
        q = query[first:last].transpose(0, 1).float()  # [heads, queries, head_size]
        scores = torch.matmul(q, keys.transpose(1, 2)) * scale
        if causal:
            positions = torch.arange(seq_len - (last - first), seq_len).unsqueeze(1)
            scores = scores.masked_fill(torch.arange(seq_len).unsqueeze(0) > positions, -torch.inf)
        attended = torch.matmul(torch.softmax(scores, dim=-1), values)
        output[first:last] = attended.transpose(0, 1).to(output.dtype)


def _rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    rope_dim_offset: int = 0,
    inverse: bool = False,
) -> None:
    """The CUDA op's in-place rotation, by vLLM's own plain-torch one (``forward_static``)."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    if rope_dim_offset or inverse:
        raise NotImplementedError("offset or inverse rotary embeddings on CPU")
    rotated_query, rotated_key = RotaryEmbedding.forward_static(
        positions, query, key, head_size, cos_sin_cache.shape[-1], cos_sin_cache, is_neox
    )
    query.copy_(rotated_query)
    if key is not None and rotated_key is not None:
        key.copy_(rotated_key)


def _scaled_fp8_quant(
    input: torch.Tensor,
    scale: torch.Tensor | None = None,
    num_token_padding: int | None = None,
    scale_ub: torch.Tensor | None = None,
    use_per_token_if_dynamic: bool = False,
    output: torch.Tensor | None = None,
    group_shape: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor FP8 quantization, static (the CUDA op's arithmetic) or dynamic, or per token."""
    if num_token_padding is not None or scale_ub is not None or group_shape not in (None, (-1, -1)):
        raise NotImplementedError("padded, bounded or grouped FP8 quantization on CPU")
    flat = input.reshape(-1, input.shape[-1])
    if scale is None and use_per_token_if_dynamic:
        quantized, scale = quantize_per_token(flat)
    else:
        if scale is None:
            scale = (flat.abs().amax().float() / FP8_MAX).reshape(1)
        quantized = quantize_static(flat, scale)
    if output is not None:
        output.copy_(quantized.view(output.shape))
        return output, scale
    return quantized.view(input.shape), scale


def _scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(scale_a * a) @ (scale_b * b)`` in float32, plus the bias, as ``out_dtype``; per-tensor,
    per-token and per-channel scales broadcast as CUTLASS's epilogue applies them."""
    flat = a.reshape(-1, a.shape[-1])
    row_scale = scale_a.float().reshape(-1, 1) if scale_a.numel() > 1 else scale_a.float()
    column_scale = scale_b.float().reshape(1, -1) if scale_b.numel() > 1 else scale_b.float()
    out = torch.matmul(flat.float(), b.float()) * row_scale * column_scale
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype).view(*a.shape[:-1], b.shape[1])


# The ops above, by the name vLLM's CPU path calls them in ``vllm._custom_ops``: the CPU
# attention backend's three, the CUTLASS kernel's FP8 pair, the rotary embedding's.
RESTATED: dict[str, Callable[..., object]] = {
    "cpu_attn_get_scheduler_metadata": _scheduler_metadata,
    "cpu_attn_reshape_and_cache": _reshape_and_cache,
    "cpu_attention_with_kv_cache": _attention_with_kv_cache,
    "scaled_fp8_quant": _scaled_fp8_quant,
    "cutlass_scaled_mm": _scaled_mm,
    "rotary_embedding": _rotary_embedding,
}


def provide_cpu_ops() -> None:
    """Give vLLM's CPU path the ops above (once per process; before the engine starts)."""
    from vllm import _custom_ops

    for name, restated in RESTATED.items():
        setattr(_custom_ops, name, restated)
    if _LIBRARIES:
        return
    _library = torch.library.Library("_C", "FRAGMENT")  # type: ignore[no-untyped-call]
    _LIBRARIES.append(_library)  # kept for the process
    for (name, schema), op in zip(
        TORCH_OPS.items(),
        (_init_cpu_memory_env, _compute_slot_mapping, _silu_and_mul_quant, _greedy_argmax),
        strict=True,
    ):
        if not hasattr(torch.ops._C, name):
            _library.define(schema)  # type: ignore[no-untyped-call]
            _library.impl(name, op, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]


@contextlib.contextmanager
def cutlass_kernel_on_cpu() -> Iterator[None]:
    """Make vLLM's CPU platform pick the CUTLASS FP8 kernel, as it does on Hopper.

    Which FP8 kernel vLLM's CPU platform selects depends on the host CPU; pinning the one the
    daemon processes for makes the comparison the same on every machine. Its post-load
    processing (transpose, pad, logical width) is plain torch; its GEMM is
    :func:`provide_cpu_ops`'s where that ran, else never called.
    """
    from vllm.model_executor.kernels import linear
    from vllm.model_executor.kernels.linear.scaled_mm import cutlass
    from vllm.platforms import PlatformEnum

    saved_kernels = linear._POSSIBLE_FP8_KERNELS.get(PlatformEnum.CPU)
    saved_supported = cutlass.cutlass_fp8_supported
    linear._POSSIBLE_FP8_KERNELS[PlatformEnum.CPU] = [cutlass.CutlassFP8ScaledMMLinearKernel]
    cutlass.cutlass_fp8_supported = lambda: True
    try:
        yield
    finally:
        cutlass.cutlass_fp8_supported = saved_supported
        if saved_kernels is not None:
            linear._POSSIBLE_FP8_KERNELS[PlatformEnum.CPU] = saved_kernels


def time_model_loads(seconds: list[float]) -> None:
    """Append how long each engine's model load took to ``seconds``: the span the GPU runner
    logs as "Model loading took" (its ``load_model``), which the CPU runner does not log."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    real = CPUModelRunner.load_model

    def timed(self: CPUModelRunner, *args: object, **kwargs: object) -> None:
        start = time.perf_counter()
        real(self, *args, **kwargs)
        seconds.append(time.perf_counter() - start)

    CPUModelRunner.load_model = timed
