"""The layers a quantization config excludes: held as vLLM's ``UnquantizedLinearMethod`` holds
them, the shards' rows fused into one contiguous ``[N, K]`` weight in the checkpoint's dtype, with
no scales, no kernel state and no padding."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from modelopt_fp8.processing.tensor_spec import FLOAT_DTYPES, TensorSpec
from modelopt_fp8.schemes.base import (
    FusedLayer,
    LaidOut,
    LinearScheme,
    ScaleFills,
    ScaleNames,
    ScaleReads,
    ShardScales,
    TorchLayer,
)
from protocol.schemas.layout import ActivationQuant, Kernel, LayerLayout


class Unquantized(LinearScheme):
    name = "unquantized"
    quant_algo = None
    weight_dtypes = FLOAT_DTYPES
    sets_kernel_state = False

    def shard_scales(self, reads: ScaleReads, prefix: str, rows: int) -> ScaleNames:
        return ScaleNames()

    def lay_out(self, layer: FusedLayer) -> LaidOut:
        n, k = layer.output_size, layer.input_size
        weight = TensorSpec.contiguous(layer.tensor("weight"), layer.weight_dtype, (n, k))
        layout = layer.layout(
            self.name,
            quant_algo=None,
            kernel=Kernel.none,
            processed_weight_dims=None,
            padded_input_size=k,
            padded_output_size=n,
            activation_quant=ActivationQuant.none,
        )
        return LaidOut(layout, weight)

    def scale_fills(self, laid: LaidOut, shards: Sequence[ShardScales]) -> ScaleFills:
        return ScaleFills((), (None,) * len(shards))

    def process_in_torch(self, layer: TorchLayer) -> None:
        """Nothing beyond the fusing every scheme shares."""

    def check_leased(self, layer: LayerLayout, kernel: str, format: str) -> None:
        """Any engine takes an unquantized layer: no kernel, no format of its own."""

    def bound_scales(self, layer: LayerLayout) -> dict[str, str | None]:
        return {}

    def export(
        self, prefix: str, weight: torch.Tensor, input_scale: float
    ) -> Iterator[tuple[str, torch.Tensor]]:
        yield f"{prefix}.weight", weight.to(torch.bfloat16).cpu()


SCHEME = Unquantized()
