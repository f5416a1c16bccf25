"""Model architectures weight-cache understands, and the linear layers vLLM builds for them.

Llama, Mistral, Qwen2 and Qwen3 share vLLM's layout: ``q/k/v_proj`` fuse into
``self_attn.qkv_proj`` (a ``QKVParallelLinear``), ``gate/up_proj`` into ``mlp.gate_up_proj`` (a
``MergedColumnParallelLinear``), ``o_proj`` and ``down_proj`` are ``RowParallelLinear``. They
differ in biases (Qwen2 has q/k/v biases) and in extra unquantized tensors (Qwen3's q/k norms),
which are carried as they are.
"""

from __future__ import annotations

import enum
import re
from array import array
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from protocol.errors import InvalidConfigError, MissingTensorError, UnsupportedArchitectureError

# vLLM's ``packed_modules_mapping`` for these models.
PACKED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


class Parallelism(str, enum.Enum):
    """How vLLM splits a linear layer across tensor-parallel ranks."""

    QKV = "qkv"  # QKVParallelLinear: heads split, kv heads replicated past their count
    MERGED_COLUMN = "merged_column"  # each shard's output rows split evenly
    ROW = "row"  # input columns split evenly


@dataclass(frozen=True)
class ArchSpec:
    name: str
    qkv_bias_default: bool  # whether q/k/v carry biases when config.json does not say


ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec("LlamaForCausalLM", qkv_bias_default=False),
    "MistralForCausalLM": ArchSpec("MistralForCausalLM", qkv_bias_default=False),
    "Qwen2ForCausalLM": ArchSpec("Qwen2ForCausalLM", qkv_bias_default=True),
    "Qwen3ForCausalLM": ArchSpec("Qwen3ForCausalLM", qkv_bias_default=False),
}


@dataclass(frozen=True)
class ModelDims:
    """The sizes config.json promises; every tensor is checked against them."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    vocab_size: int
    qkv_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


@dataclass(frozen=True)
class ShardSpec:
    """One checkpoint projection that feeds a (possibly fused) vLLM layer."""

    checkpoint_prefix: str  # e.g. model.layers.0.self_attn.k_proj
    shard_id: str  # "q"/"k"/"v" or "0"/"1" as vLLM's weight loaders name them
    rows: int  # output width in the whole (unsharded) model


@dataclass(frozen=True)
class LinearSpec:
    """A linear layer as vLLM builds it, with the checkpoint shards it is made of."""

    prefix: str  # vLLM module name, e.g. model.layers.0.self_attn.qkv_proj
    parallelism: Parallelism
    shards: tuple[ShardSpec, ...]
    input_size: int  # K of the whole model
    has_bias: bool

    @property
    def output_size(self) -> int:
        return sum(s.rows for s in self.shards)


def _int(config: dict[str, Any], key: str, source: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidConfigError(
            f"config.json field {key!r} must be a positive integer, got {value!r}", file=source
        )
    return value


def read_dims(config: dict[str, Any], source: str) -> ModelDims:
    """Model sizes from config.json, for one of the supported architectures."""
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise InvalidConfigError("config.json has no 'architectures' list", file=source)
    spec = ARCHITECTURES.get(archs[0])
    if spec is None:
        raise UnsupportedArchitectureError(
            f"architecture {archs[0]!r} is not supported; supported: {', '.join(ARCHITECTURES)}",
            file=source,
            architecture=archs[0],
        )
    hidden = _int(config, "hidden_size", source)
    heads = _int(config, "num_attention_heads", source)
    kv_heads = _int(config, "num_key_value_heads", source, default=heads)
    head_dim_raw = config.get("head_dim")
    head_dim = _int(config, "head_dim", source) if head_dim_raw is not None else hidden // heads
    if head_dim_raw is None and hidden % heads:
        raise InvalidConfigError(
            "hidden_size is not a multiple of num_attention_heads and head_dim is unset",
            file=source,
        )
    if heads % kv_heads:
        raise InvalidConfigError(
            "num_attention_heads must be a multiple of num_key_value_heads", file=source
        )
    bias = config.get("attention_bias", spec.qkv_bias_default)
    return ModelDims(
        architecture=spec.name,
        hidden_size=hidden,
        intermediate_size=_int(config, "intermediate_size", source),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        num_hidden_layers=_int(config, "num_hidden_layers", source),
        vocab_size=_int(config, "vocab_size", source),
        qkv_bias=bool(bias),
        mlp_bias=bool(config.get("mlp_bias", False)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


def _row_parallel(prefix: str, output_size: int, input_size: int, bias: bool) -> LinearSpec:
    """A ``RowParallelLinear``: one checkpoint projection, its input split over the ranks."""
    shards = (ShardSpec(prefix, "0", output_size),)
    return LinearSpec(prefix, Parallelism.ROW, shards, input_size, bias)


def layer_linear_specs(dims: ModelDims, i: int) -> list[LinearSpec]:
    """The linear layers of decoder layer ``i``, in the order vLLM creates them."""
    h, inter = dims.hidden_size, dims.intermediate_size
    attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
    qkv = (
        ShardSpec(f"{attn}.q_proj", "q", dims.q_size),
        ShardSpec(f"{attn}.k_proj", "k", dims.kv_size),
        ShardSpec(f"{attn}.v_proj", "v", dims.kv_size),
    )
    gate_up = (
        ShardSpec(f"{mlp}.gate_proj", "0", inter),
        ShardSpec(f"{mlp}.up_proj", "1", inter),
    )
    return [
        LinearSpec(f"{attn}.qkv_proj", Parallelism.QKV, qkv, h, dims.qkv_bias),
        _row_parallel(f"{attn}.o_proj", h, dims.q_size, False),
        LinearSpec(f"{mlp}.gate_up_proj", Parallelism.MERGED_COLUMN, gate_up, h, dims.mlp_bias),
        _row_parallel(f"{mlp}.down_proj", h, inter, dims.mlp_bias),
    ]


def linear_specs(dims: ModelDims) -> list[LinearSpec]:
    """Every linear layer of the decoder stack, in the order vLLM creates them."""
    return [spec for i in range(dims.num_hidden_layers) for spec in layer_linear_specs(dims, i)]


def layer_weight_names(dims: ModelDims, i: int) -> list[str]:
    """The checkpoint's linear weights decoder layer ``i`` is made of."""
    return [
        f"{shard.checkpoint_prefix}.weight"
        for spec in layer_linear_specs(dims, i)
        for shard in spec.shards
    ]


def kv_scale_names(dims: ModelDims) -> dict[str, tuple[str, ...]]:
    """vLLM parameter name of each KV-cache scale -> checkpoint names it may be stored under
    (as vLLM's ``maybe_remap_kv_scale_name`` accepts them)."""
    names: dict[str, tuple[str, ...]] = {}
    for i in range(dims.num_hidden_layers):
        attn = f"model.layers.{i}.self_attn"
        for kind in ("k", "v"):
            names[f"{attn}.attn.{kind}_scale"] = (
                f"{attn}.{kind}_proj.{kind}_scale",
                f"{attn}.{kind}_scale",
            )
    return names


_LAYER = re.compile(r"^model\.layers\.(\d{1,9})\.")


# The least a safetensors header spends on one tensor besides its name: quotes, colon, comma
# and the shortest entry the format allows.
_MIN_ENTRY_BYTES = len('"":{"dtype":"U8","shape":[],"data_offsets":[0,0]},')


def check_header_room(dims: ModelDims, header_bytes: int, source: str) -> None:
    """Before a header is read: the linear weights of the layers the config promises, each at
    the least bytes a header can spend on it, must fit in the headers' lengths."""
    per_layer = sum(len(name) + _MIN_ENTRY_BYTES for name in layer_weight_names(dims, 0))
    if dims.num_hidden_layers * per_layer > header_bytes:
        raise InvalidConfigError(
            f"config.json says num_hidden_layers is {dims.num_hidden_layers}: their linear "
            f"weights need at least {dims.num_hidden_layers * per_layer} bytes of safetensors "
            f"headers, which hold {header_bytes}",
            file=source,
            field="num_hidden_layers",
        )


_NAMED_LAYER = re.compile(rb'"model\.layers\.(\d{1,9})\.')
_ENTRY = b'"data_offsets"'  # once in every tensor's entry


def check_raw_headers(dims: ModelDims, headers: Sequence[bytes], source: str) -> None:
    """What the config promises, against the safetensors headers as bytes, before an object is
    built per tensor (parsing tens of thousands of entries, several loads at once, leaves the
    daemon's heap scattered long after they are freed): at least as many tensors as the
    promised layers' linear weights, no layer past the promised ones, and each layer named by
    at least as many tensors as its linear weights. The bytes can only overcount (a metadata
    value may repeat a name), so what passes here is checked again by name once parsed
    (:func:`check_layers`); headers that list no tensor at all are left for the parse to
    call corrupt."""
    needed = len(layer_weight_names(dims, 0))
    layers = dims.num_hidden_layers
    entries = sum(raw.count(_ENTRY) for raw in headers)
    if not entries:
        return  # no tensor listing at all: the parse says what is wrong with the headers
    if layers * needed > entries:
        raise InvalidConfigError(
            f"config.json says num_hidden_layers is {layers}: {layers * needed} linear weights, "
            f"but the safetensors headers hold at most {entries} tensors",
            file=source,
            field="num_hidden_layers",
        )
    named = array("L", [0]) * layers  # tensors named per layer
    for raw in headers:
        for match in _NAMED_LAYER.finditer(raw):
            i = int(match.group(1))
            if i >= layers:
                raise InvalidConfigError(
                    f"config.json says num_hidden_layers is {layers}, the safetensors headers "
                    f"name layer {i}",
                    file=source,
                    field="num_hidden_layers",
                )
            named[i] += 1
    short = next((i for i, n in enumerate(named) if n < needed), None)
    if short is not None:
        raise InvalidConfigError(
            f"the safetensors headers name {named[short]} tensors of layer {short}, fewer than "
            f"its {needed} linear weights (config.json says num_hidden_layers is {layers})",
            file=source,
            field="num_hidden_layers",
        )


def check_dims(dims: ModelDims, shapes: Mapping[str, tuple[int, ...]], source: str) -> None:
    """Refuse a config whose layers or sizes the headers do not hold, before anything is
    planned (:func:`check_layers`, then :func:`_check_sizes`)."""
    check_layers(dims, shapes, source)
    _check_sizes(dims, shapes, source)


def check_layers(dims: ModelDims, shapes: Mapping[str, tuple[int, ...]], source: str) -> None:
    """A config drives how much is planned (``num_hidden_layers`` layers of specs): a lying one
    must cost what the headers hold, not a plan per promised layer. So, before any spec is
    built: the layers the headers name must be the layers promised, every one of them, each
    with at least as many tensors as its linear weights, and then, layer by layer (stopping at
    the first that lacks one), those weights by name."""
    per_layer = _check_layer_count(dims, shapes, source)
    _check_linear_weights_present(dims, shapes, per_layer)


def _check_layer_count(
    dims: ModelDims, shapes: Mapping[str, tuple[int, ...]], source: str
) -> Counter[int]:
    """``num_hidden_layers`` is the number of layers the headers name, each of them present;
    how many tensors the headers name of each."""
    per_layer = Counter(int(m.group(1)) for name in shapes if (m := _LAYER.match(name)))
    found = max(per_layer) + 1 if per_layer else 0
    if dims.num_hidden_layers != found:
        raise InvalidConfigError(
            f"config.json says num_hidden_layers is {dims.num_hidden_layers}, the safetensors "
            f"headers hold {found} layers",
            file=source,
            field="num_hidden_layers",
        )
    # Every promised layer must be there with its weights, or a single tensor named for the
    # last layer would have a lying config planned in full. Each loop (this one and
    # _check_linear_weights_present's) stops at the first layer that falls short, so none
    # costs more than the headers hold.
    if len(per_layer) != found:
        gap = next(i for i in range(found) if i not in per_layer)
        raise InvalidConfigError(
            f"config.json says num_hidden_layers is {dims.num_hidden_layers}, but the safetensors "
            f"headers hold no tensor of layer {gap} (they name {len(per_layer)} layers)",
            file=source,
            field="num_hidden_layers",
        )
    return per_layer


def _check_linear_weights_present(
    dims: ModelDims, shapes: Mapping[str, tuple[int, ...]], per_layer: Counter[int]
) -> None:
    """Every linear layer's weight is in the headers (``num_hidden_layers`` checked first):
    the first layer that names fewer tensors than its linear weights alone, if there is one,
    else every layer."""
    needed = len(layer_weight_names(dims, 0))
    found = dims.num_hidden_layers
    short = next((i for i in range(found) if per_layer[i] < needed), None)
    for i in range(found) if short is None else (short,):
        for name in layer_weight_names(dims, i):
            if name not in shapes:
                raise MissingTensorError(
                    "a linear layer's weight is not in the checkpoint", tensor=name
                )


def _sizes_in(shapes: Mapping[str, tuple[int, ...]], *names_axes: tuple[str, int]) -> set[int]:
    """The sizes of the 2-D tensors named, each along its axis (absent ones give none)."""
    out = set()
    for name, axis in names_axes:
        shape = shapes.get(name)
        if shape is not None and len(shape) == 2:
            out.add(shape[axis])
    return out


def _check_sizes(dims: ModelDims, shapes: Mapping[str, tuple[int, ...]], source: str) -> None:
    """Each size the config gives must show in at least one tensor that defines it; a single
    tensor of the wrong shape is left for the planner to name."""
    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    evidence = {
        "hidden_size": (
            dims.hidden_size,
            _sizes_in(
                shapes,
                ("model.embed_tokens.weight", 1),
                ("lm_head.weight", 1),
                (f"{attn}.q_proj.weight", 1),
                (f"{attn}.o_proj.weight", 0),
                (f"{mlp}.gate_proj.weight", 1),
                (f"{mlp}.down_proj.weight", 0),
            ),
        ),
        "vocab_size": (
            dims.vocab_size,
            _sizes_in(shapes, ("model.embed_tokens.weight", 0), ("lm_head.weight", 0)),
        ),
        "intermediate_size": (
            dims.intermediate_size,
            _sizes_in(
                shapes,
                (f"{mlp}.gate_proj.weight", 0),
                (f"{mlp}.up_proj.weight", 0),
                (f"{mlp}.down_proj.weight", 1),
            ),
        ),
        "num_attention_heads": (
            dims.q_size,
            _sizes_in(shapes, (f"{attn}.q_proj.weight", 0), (f"{attn}.o_proj.weight", 1)),
        ),
        "num_key_value_heads": (
            dims.kv_size,
            _sizes_in(shapes, (f"{attn}.k_proj.weight", 0), (f"{attn}.v_proj.weight", 0)),
        ),
    }
    for field_name, (promised, seen) in evidence.items():
        if seen and promised not in seen:
            raise InvalidConfigError(
                f"config.json's {field_name} gives {promised}, but the tensors that carry it "
                f"have {sorted(seen)}",
                file=source,
                field=field_name,
            )
