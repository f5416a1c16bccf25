"""ModelOpt ``FP8_PER_CHANNEL_PER_TOKEN``: one weight scale per output row, activations
quantized per token at run time (no input scale).

vLLM 0.33 (``KFp8StaticChannel.process`` in ``quantization/modelopt.py``, through
``fp8_utils.process_fp8_weight_channel_strategy``): the fused layer's scales are the shards' rows
one after another, padded with 1.0 to the CUTLASS width; the weight is never requantized.
ModelOpt exports ``scale = amax / 448`` per output row.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from modelopt_fp8.processing.cutlass import pad_to_alignment
from modelopt_fp8.processing.fp8 import FP8_DTYPE, FP8_MAX
from modelopt_fp8.processing.rows import SmallFill
from modelopt_fp8.processing.tensor_spec import TensorSpec
from modelopt_fp8.schemes.base import (
    FusedLayer,
    LaidOut,
    ScaleFills,
    ScaleNames,
    ScaleReads,
    ShardScales,
    TorchLayer,
)
from modelopt_fp8.schemes.cutlass_fp8 import CutlassFp8Scheme
from protocol.schemas.layout import ActivationQuant


def _rank_rows(shards: Sequence[ShardScales]) -> torch.Tensor:
    """The per-channel scales of this rank's rows of every shard, one after another."""
    parts = []
    for shard in shards:
        assert shard.weight_scale is not None, "per-channel shards carry a weight scale"
        parts.append(shard.weight_scale.reshape(-1)[shard.rows[0] : shard.rows[1]])
    return torch.cat(parts).to(torch.float32)


class Fp8PerChannel(CutlassFp8Scheme):
    name = "fp8_pc_pt"
    quant_algo = "FP8_PER_CHANNEL_PER_TOKEN"
    activation_quant = ActivationQuant.dynamic_per_token

    def shard_scales(self, reads: ScaleReads, prefix: str, rows: int) -> ScaleNames:
        names = ScaleNames(f"{prefix}.weight_scale")
        reads.scale(names.weight_scale or "", (rows,), (rows, 1))
        return names

    def scale_specs(self, layer: FusedLayer) -> tuple[TensorSpec, TensorSpec | None]:
        padded = (pad_to_alignment(layer.output_size),)
        return TensorSpec.contiguous(layer.tensor("weight_scale"), torch.float32, padded), None

    def scale_fills(self, laid: LaidOut, shards: Sequence[ShardScales]) -> ScaleFills:
        spec = laid.weight_scale
        assert spec is not None

        def padded() -> torch.Tensor:
            joined = _rank_rows(shards)
            out = torch.ones(spec.storage_shape, dtype=torch.float32)
            out[: joined.numel()] = joined
            return out

        return ScaleFills((SmallFill(spec, padded),), (None,) * len(shards))

    def process_in_torch(self, layer: TorchLayer) -> None:
        assert layer.weight_scale is not None
        joined = _rank_rows(layer.shards)
        layer.weight_scale[: joined.numel()].copy_(joined)
        layer.weight_scale[joined.numel() :].fill_(1.0)

    def export(
        self, prefix: str, weight: torch.Tensor, input_scale: float
    ) -> Iterator[tuple[str, torch.Tensor]]:
        scale = (weight.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
        quantized = (weight / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        yield f"{prefix}.weight", quantized.cpu()
        yield f"{prefix}.weight_scale", scale.to(torch.float32).cpu()


SCHEME = Fp8PerChannel()
