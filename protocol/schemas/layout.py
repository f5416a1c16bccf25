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


class Kernel(str, enum.Enum):
    cutlass = "cutlass"  # vLLM's CutlassFP8ScaledMMLinearKernel layout
    none = "none"  # unquantized layers: no scaled-mm kernel


class WeightFormat(str, enum.Enum):
    default = "default"  # weight as a [K, N] column-major view, K and N padded to 16


class ActivationQuant(str, enum.Enum):
    static_per_tensor = "static_per_tensor"
    dynamic_per_token = "dynamic_per_token"
    none = "none"


class CarriedKind(str, enum.Enum):
    """How a tensor outside the linear layers is held, and so how an engine takes it."""

    vocab_parallel = "vocab_parallel"  # embed_tokens / lm_head: this rank's rows, padded as vLLM
    replicated = "replicated"  # norms: every rank holds the whole tensor as stored
    checkpoint = "checkpoint"  # KV-cache scales: as stored; the engine's own loaders consume them


class CarriedLayout(BaseModel):
    """One tensor that is not part of a linear layer, as vLLM 0.33 holds it after loading.

    ``vocab_parallel`` tensors follow ``VocabParallelEmbedding``: the vocabulary padded to a
    multiple of ``padding_size``, split evenly over the TP ranks, rows past the real vocabulary
    zero (``VocabParallelEmbedding.__init__`` and its weight loader). An engine binds
    ``vocab_parallel`` and ``replicated`` tensors as its parameters, zero-copy; ``checkpoint``
    ones go through its weight loaders (a few scalars).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="vLLM parameter name")
    kind: CarriedKind
    source: str = Field(description="checkpoint tensor it comes from")
    vocab_size: int | None = Field(default=None, description="the real vocabulary (org_vocab_size)")
    padding_size: int | None = Field(default=None, description="vocabulary padding multiple")
    vocab_start: int | None = Field(default=None, description="first vocabulary row of this rank")
    vocab_end: int | None = Field(
        default=None, description="one past the last real vocabulary row of this rank"
    )


class LayerLayout(BaseModel):
    """One linear layer as vLLM 0.33 leaves it after processing for its kernel."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="vLLM module name, e.g. model.layers.0.self_attn.qkv_proj")
    scheme: str = Field(
        pattern=r"^[a-z0-9_]{1,64}$",
        description="the name of its quantization scheme (e.g. fp8, unquantized); an engine "
        "refuses a name it does not know",
    )
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
