"""ModelOpt ``FP8``: a per-tensor weight scale and a static per-tensor input scale per shard.

vLLM 0.33 (``KFp8StaticTensor.process`` in ``quantization/modelopt.py``): the fused layer's weight
scale is the shards' max; when the shard scales differ, every shard is requantized to it through
float16 (``w8a8_utils.requantize_with_max_scale``); the input scale is the shards' max.
ModelOpt exports ``scale = amax / 448`` over the whole weight.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from modelopt_fp8.processing.fp8 import FP8_DTYPE, FP8_MAX, CodeMap, requantize_lut, requantize_map
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

_GATHER_ROWS_BYTES = 1 << 22  # bytes per host gather: bounds its temporaries


def _scalar(t: torch.Tensor | None) -> torch.Tensor:
    assert t is not None, "FP8 shards carry per-tensor scales"
    return t.reshape(()).to(torch.float32)


def requantize_maps(
    shard_scales: Sequence[torch.Tensor | None],
) -> tuple[torch.Tensor, list[CodeMap | None]]:
    """The fused layer's weight scale (the max) and, per shard, the code map that requantizes
    it, or None where its bytes stay as they are.

    vLLM requantizes every shard, the max-scale one included, as soon as any scale differs
    (its round trip through float16 may move a code); a map that is the identity is dropped,
    which leaves the same bytes.
    """
    scales = torch.stack([_scalar(s) for s in shard_scales])
    max_scale = scales.max()
    if bool((scales == scales[0]).all()):
        return max_scale, [None] * len(shard_scales)
    maps: list[CodeMap | None] = []
    for scale in scales:
        code_map = requantize_map(scale, max_scale)
        maps.append(None if code_map.identity else code_map)
    return max_scale, maps


def _requantize_in_place(weight: torch.Tensor, lut: torch.Tensor) -> None:
    """Replace every e4m3 code of ``weight`` (2-D, any strides, any device) by ``lut[code]``."""
    codes = weight.view(torch.uint8)
    if codes.device.type != "cpu":
        codes.copy_(lut.to(codes.device)[codes.long()])
        return
    table = lut.numpy()
    array = codes.numpy()
    step = max(1, _GATHER_ROWS_BYTES // max(1, array.shape[1]))
    for start in range(0, array.shape[0], step):
        block = array[start : start + step]
        block[...] = table[block]


class Fp8PerTensor(CutlassFp8Scheme):
    name = "fp8"
    quant_algo = "FP8"
    activation_quant = ActivationQuant.static_per_tensor

    def shard_scales(self, reads: ScaleReads, prefix: str, rows: int) -> ScaleNames:
        names = ScaleNames(f"{prefix}.weight_scale", f"{prefix}.input_scale")
        for name in (names.weight_scale, names.input_scale):
            reads.scale(name or "", (), (1,))
        return names

    def scale_specs(self, layer: FusedLayer) -> tuple[TensorSpec, TensorSpec | None]:
        return (
            TensorSpec.contiguous(layer.tensor("weight_scale"), torch.float32, ()),
            TensorSpec.contiguous(layer.tensor("input_scale"), torch.float32, ()),
        )

    def scale_fills(self, laid: LaidOut, shards: Sequence[ShardScales]) -> ScaleFills:
        assert laid.weight_scale is not None and laid.input_scale is not None
        max_scale, maps = requantize_maps([s.weight_scale for s in shards])
        input_scale = torch.stack([_scalar(s.input_scale) for s in shards])
        fills = (
            SmallFill(laid.weight_scale, max_scale.clone),
            SmallFill(laid.input_scale, input_scale.max),
        )
        return ScaleFills(fills, tuple(maps))

    def process_in_torch(self, layer: TorchLayer) -> None:
        assert layer.weight_scale is not None and layer.input_scale is not None
        scales = torch.stack([_scalar(s.weight_scale) for s in layer.shards])
        max_scale = scales.max()
        if not bool((scales == scales[0]).all()):
            for rows, scale in zip(layer.weights, scales, strict=True):
                _requantize_in_place(rows, requantize_lut(scale, max_scale))
        layer.weight_scale.copy_(max_scale)
        layer.input_scale.copy_(torch.stack([_scalar(s.input_scale) for s in layer.shards]).max())

    def export(
        self, prefix: str, weight: torch.Tensor, input_scale: float
    ) -> Iterator[tuple[str, torch.Tensor]]:
        scale = (weight.abs().amax() / FP8_MAX).clamp(min=1e-12)
        quantized = (weight / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        yield f"{prefix}.weight", quantized.cpu()
        yield f"{prefix}.weight_scale", scale.to(torch.float32).cpu()
        yield f"{prefix}.input_scale", torch.tensor(input_scale, dtype=torch.float32)


SCHEME = Fp8PerTensor()
