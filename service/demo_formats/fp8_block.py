"""Block FP8 as Qwen3-FP8 and DeepSeek export it (vLLM's ``Fp8Config`` with
``weight_block_size``): each weight ``float8_e4m3fn``, quantized per 128x128 block, its
``weight_scale_inv`` one float32 per block (``[ceil(N/128), ceil(K/128)]``: the factor that
dequantizes it), activations quantized dynamically. The daemon does not process it: engines
load it with vLLM's loader and donate it."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from modelopt_fp8.checkpoint.architecture import LinearSpec
from modelopt_fp8.processing.fp8 import FP8_DTYPE, FP8_MAX
from service.demo_formats.base import DemoFormat

BLOCK = 128  # rows and columns of one block, as Qwen3-FP8's weight_block_size


class Fp8Block(DemoFormat):
    name = "fp8-block"
    kv_cache_scales = False

    def export(
        self, prefix: str, weight: torch.Tensor, input_scale: float
    ) -> Iterator[tuple[str, torch.Tensor]]:
        n, k = weight.shape
        rows, cols = math.ceil(n / BLOCK), math.ceil(k / BLOCK)
        # The last blocks of a width that is not a multiple are partial: padded with zeros,
        # which change no block's amax.
        padded = F.pad(weight.float(), (0, cols * BLOCK - k, 0, rows * BLOCK - n))
        blocks = padded.view(rows, BLOCK, cols, BLOCK)
        scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
        quantized = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        yield f"{prefix}.weight", quantized.view(rows * BLOCK, cols * BLOCK)[:n, :k].cpu()
        yield f"{prefix}.weight_scale_inv", scale.to(torch.float32).cpu()

    def quantization_config(self, kv_cache: bool) -> dict[str, Any]:
        return {
            "quant_method": "fp8",
            "weight_block_size": [BLOCK, BLOCK],
            "activation_scheme": "dynamic",
        }

    def check_layer(self, spec: LinearSpec) -> None:
        """vLLM (``validate_fp8_block_shape``, at TP 1) needs every shard of a fused layer but
        the last to fill whole blocks of rows."""
        for shard in spec.shards[:-1]:
            if shard.rows % BLOCK:
                raise ValueError(
                    f"{shard.checkpoint_prefix} has {shard.rows} rows, not a multiple of the "
                    f"{BLOCK}-row block vLLM needs of it in {spec.prefix}; pick a shape whose "
                    "widths are multiples of 128"
                )


FORMAT = Fp8Block()
