"""What the FP8 schemes on vLLM 0.33's CUTLASS kernel share (``CutlassFP8ScaledMMLinearKernel``):
an e4m3 weight exposed as the ``[K, N]`` column-major view over storage padded to 16 both ways,
``processed_weight_dims = (0, 1)``, vLLM's kernel state set on the module, and an engine that
takes the layer only on the kernel and format it was processed for. A scheme on this kernel says
its scales: their tensors, how they fuse, and how activations are quantized."""

from __future__ import annotations

import abc
from typing import ClassVar

from modelopt_fp8.processing.cutlass import weight_storage_shape, weight_view
from modelopt_fp8.processing.fp8 import FP8_DTYPE
from modelopt_fp8.processing.tensor_spec import TensorSpec
from modelopt_fp8.schemes.base import FusedLayer, LaidOut, LinearScheme
from protocol.errors import VerificationError
from protocol.reasons import Reason
from protocol.schemas.layout import ActivationQuant, Kernel, LayerLayout


class CutlassFp8Scheme(LinearScheme):
    """A scheme whose layers vLLM runs on its CUTLASS FP8 kernel."""

    weight_dtypes = (FP8_DTYPE,)
    sets_kernel_state = True
    activation_quant: ClassVar[ActivationQuant]

    @abc.abstractmethod
    def scale_specs(self, layer: FusedLayer) -> tuple[TensorSpec, TensorSpec | None]:
        """The processed weight scale and input scale (None: activations are quantized at run
        time) of ``layer``."""

    def lay_out(self, layer: FusedLayer) -> LaidOut:
        n, k = layer.output_size, layer.input_size
        n_pad, k_pad = weight_storage_shape(n, k)
        shape, stride = weight_view(n, k)
        weight = TensorSpec(layer.tensor("weight"), FP8_DTYPE, (n_pad, k_pad), shape, stride)
        weight_scale, input_scale = self.scale_specs(layer)
        layout = layer.layout(
            self.name,
            quant_algo=layer.quant_algo,
            kernel=Kernel.cutlass,
            processed_weight_dims=(0, 1),
            padded_input_size=k_pad,
            padded_output_size=n_pad,
            activation_quant=self.activation_quant,
            weight_scale_shape=list(weight_scale.shape),
            input_scale_shape=list(input_scale.shape) if input_scale else None,
            weight_scale=weight_scale.name,
            input_scale=input_scale.name if input_scale else None,
        )
        return LaidOut(layout, weight, weight_scale, input_scale)

    def check_leased(self, layer: LayerLayout, kernel: str, format: str) -> None:
        if layer.kernel.value != kernel:
            raise VerificationError(
                f"{layer.name} was processed for {layer.kernel.value}, the engine selected "
                f"{kernel}",
                reason=Reason.kernel_mismatch,
                layer=layer.name,
            )
        if layer.format.value != format:
            raise VerificationError(
                f"{layer.name} is in format {layer.format.value}, the engine expects {format}",
                reason=Reason.format_mismatch,
                layer=layer.name,
            )
        if layer.processed_weight_dims != (0, 1):
            raise VerificationError(
                f"{layer.name} has no [K, N] weight view", reason=Reason.manifest_invalid
            )

    def bound_scales(self, layer: LayerLayout) -> dict[str, str | None]:
        return {"weight_scale": layer.weight_scale, "input_scale": layer.input_scale}
