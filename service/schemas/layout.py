"""How a processed linear layer is laid out: the part of the manifest that says what vLLM's
``process_weights_after_loading`` would have left on the layer, so the engine re-runs nothing."""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field


class WireDType(str, enum.Enum):
    """The closed list of dtypes a leased tensor may have."""

    float8_e4m3fn = "float8_e4m3fn"
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"


class Scheme(str, enum.Enum):
    fp8 = "fp8"  # ModelOpt FP8: per-tensor weight scale, static per-tensor input scale
    fp8_pc_pt = "fp8_pc_pt"  # FP8_PER_CHANNEL_PER_TOKEN: per-channel weight, per-token input
    unquantized = "unquantized"  # excluded from quantization; kept in the model dtype


class Kernel(str, enum.Enum):
    cutlass = "cutlass"  # vLLM's CutlassFP8ScaledMMLinearKernel layout
    none = "none"  # unquantized layers: no scaled-mm kernel


class WeightFormat(str, enum.Enum):
    default = "default"  # weight as a [K, N] column-major view, K and N padded to 16


class ActivationQuant(str, enum.Enum):
    static_per_tensor = "static_per_tensor"
    dynamic_per_token = "dynamic_per_token"
    none = "none"


class LayerLayout(BaseModel):
    """One linear layer as vLLM 0.33 leaves it after processing for its kernel."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="vLLM module name, e.g. model.layers.0.self_attn.qkv_proj")
    scheme: Scheme
    quant_algo: str | None = Field(description="ModelOpt quant_algo, null when unquantized")
    kernel: Kernel
    format: WeightFormat
    processed_weight_dims: tuple[int, int] | None = Field(
        description="(0, 1) for the [K, N] weight view vLLM marks on processed FP8 layers"
    )
    input_size: int = Field(description="logical K of this rank's shard")
    padded_input_size: int = Field(description="K padded to 16 for CUTLASS")
    output_size: int = Field(description="logical N: CUTLASS' logical_output_size")
    padded_output_size: int = Field(description="N padded to 16 for CUTLASS")
    logical_widths: list[int] = Field(description="width of each fused shard on this rank")
    shard_names: list[str] = Field(description="checkpoint projections fused into this layer")
    activation_quant: ActivationQuant
    weight_scale_shape: list[int] | None = None
    input_scale_shape: list[int] | None = None
    weight: str = Field(description="tensor name of the weight")
    weight_scale: str | None = None
    input_scale: str | None = None
    bias: str | None = None

    def tensor_names(self) -> list[str]:
        """The names of the tensors this layer owns in the arena."""
        return [n for n in (self.weight, self.weight_scale, self.input_scale, self.bias) if n]
