"""The processing plan: every tensor one TP rank of a model will hold, with its size and layout,
worked out from headers and scales alone.

Planning is where a checkpoint is judged: missing tensors, wrong dtypes, shapes that disagree with
config.json and bad scales are all refused here, before a byte of the arena is allocated, so a
refused model leaves nothing half-built behind.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from modelopt_fp8.checkpoint import Checkpoint, LinearSpec
from modelopt_fp8.checkpoint.architecture import kv_scale_names, linear_specs
from modelopt_fp8.checkpoint.safetensors_files import TensorInfo
from modelopt_fp8.processing.cutlass import pad_to_alignment, weight_storage_shape, weight_view
from modelopt_fp8.processing.fp8 import FP8_DTYPE
from modelopt_fp8.processing.tensor_parallel import ShardSlice, check_tp_size, shard_slice
from protocol.errors import (
    InvalidScaleError,
    MissingTensorError,
    TensorDtypeError,
    TensorShapeError,
    UnsupportedQuantAlgoError,
)
from protocol.schemas.layout import (
    ActivationQuant,
    CarriedKind,
    CarriedLayout,
    Kernel,
    LayerLayout,
    Scheme,
    WeightFormat,
)

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)  # vLLM never loads these
# vLLM pads the vocabulary of embeddings and LM heads to this multiple before splitting it over
# the TP ranks (``vocab_parallel_embedding.py:36, 95-97``; no LoRA, so no added vocabulary).
VOCAB_PADDING_SIZE = 64
VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be held: its contiguous storage and the (possibly strided) view exposed."""

    name: str
    dtype: torch.dtype
    storage_shape: tuple[int, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @classmethod
    def contiguous(cls, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> TensorSpec:
        return cls(name, dtype, shape, shape, contiguous_stride(shape))

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.storage_shape:
            n *= d
        return n

    def view(self, storage: torch.Tensor) -> torch.Tensor:
        """The exposed tensor over a contiguous ``storage`` of :attr:`storage_shape`."""
        return storage.as_strided(self.shape, self.stride)

    def storage_of(self, view: torch.Tensor) -> torch.Tensor:
        """The contiguous storage behind a tensor made by :meth:`view` (the inverse)."""
        return view.as_strided(self.storage_shape, contiguous_stride(self.storage_shape))


@dataclass(frozen=True)
class ShardSource:
    """Where one fused shard's data comes from on this rank."""

    weight: str
    slice: ShardSlice
    weight_scale: str | None
    input_scale: str | None
    bias: str | None


@dataclass(frozen=True)
class LinearPlan:
    layout: LayerLayout
    shards: tuple[ShardSource, ...]
    weight: TensorSpec
    weight_scale: TensorSpec | None
    input_scale: TensorSpec | None
    bias: TensorSpec | None

    @property
    def specs(self) -> list[TensorSpec]:
        return [s for s in (self.weight, self.weight_scale, self.input_scale, self.bias) if s]


@dataclass(frozen=True)
class CarriedPlan:
    """A tensor outside the linear layers, held as vLLM holds it after loading: norms and KV
    scales as stored, embeddings and the LM head as this rank's padded vocabulary rows."""

    spec: TensorSpec
    layout: CarriedLayout

    @property
    def source(self) -> str:
        return self.layout.source

    @property
    def rows(self) -> tuple[int, int] | None:
        """The checkpoint rows this rank holds (vocabulary-parallel tensors only); the storage
        rows after them are zero padding."""
        if self.layout.kind is not CarriedKind.vocab_parallel:
            return None
        assert self.layout.vocab_start is not None and self.layout.vocab_end is not None
        return self.layout.vocab_start, self.layout.vocab_end


def vocab_shard(vocab_size: int, tp_size: int, tp_rank: int) -> tuple[int, int, int]:
    """(rows per rank, first row, one past the last real row) of ``VocabParallelEmbedding``'s
    shard for this rank: the padded vocabulary split evenly, padding rows past ``vocab_size``
    (``vocab_parallel_embedding.py:379-414``)."""
    padded = -(-vocab_size // VOCAB_PADDING_SIZE) * VOCAB_PADDING_SIZE
    per_rank = padded // tp_size
    start = min(tp_rank * per_rank, vocab_size)
    return per_rank, start, min(tp_rank * per_rank + per_rank, vocab_size)


@dataclass
class ModelPlan:
    quant_algo: str
    tp_size: int
    tp_rank: int
    linears: list[LinearPlan]
    carried: list[CarriedPlan]
    # Every scale, read and validated while planning: tiny, and needed again to process.
    scales: dict[str, torch.Tensor] = field(repr=False)

    @property
    def specs(self) -> list[TensorSpec]:
        out = [s for lp in self.linears for s in lp.specs]
        out.extend(c.spec for c in self.carried)
        return out

    @property
    def layouts(self) -> list[LayerLayout]:
        return [lp.layout for lp in self.linears]

    @property
    def carried_layouts(self) -> list[CarriedLayout]:
        return [c.layout for c in self.carried]

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


class _Planner:
    def __init__(self, ckpt: Checkpoint, tp_size: int, tp_rank: int) -> None:
        self.ckpt = ckpt
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.algo = ckpt.quant.quant_algo
        self.scales: dict[str, torch.Tensor] = {}
        self.consumed: set[str] = set()

    # --- checks -------------------------------------------------------------------------------

    def _info(self, name: str) -> TensorInfo:
        info = self.ckpt.tensors.get(name)
        if info is None:
            raise MissingTensorError(
                "tensor required by the model config is missing",
                tensor=name,
                file=str(self.ckpt.path),
            )
        self.consumed.add(name)
        return info

    @staticmethod
    def _expect_dtype(info: TensorInfo, allowed: tuple[torch.dtype, ...]) -> None:
        if info.dtype not in allowed:
            raise TensorDtypeError(
                f"dtype is {info.dtype}, expected {' or '.join(str(d) for d in allowed)}",
                file=str(info.file),
                tensor=info.name,
            )

    @staticmethod
    def _expect_shape(info: TensorInfo, *shapes: tuple[int, ...]) -> None:
        if info.shape not in shapes:
            raise TensorShapeError(
                f"shape is {list(info.shape)}, config.json implies "
                f"{' or '.join(str(list(s)) for s in shapes)}",
                file=str(info.file),
                tensor=info.name,
            )

    def _scale(self, name: str, *shapes: tuple[int, ...]) -> torch.Tensor:
        info = self._info(name)
        self._expect_dtype(info, (torch.float32,))
        self._expect_shape(info, *shapes)
        value = self.ckpt.read(name).to(torch.float32)
        bad = ~torch.isfinite(value) | (value <= 0)
        if bool(bad.any()):
            first = float(value.reshape(-1)[bad.reshape(-1)][0])
            raise InvalidScaleError(
                f"scale must be finite and positive, found {first}",
                file=str(info.file),
                tensor=name,
            )
        self.scales[name] = value
        return value

    # --- linear layers ------------------------------------------------------------------------

    def linear(self, spec: LinearSpec) -> LinearPlan:
        scheme = self.ckpt.quant.scheme_for(spec.prefix)
        quantized = scheme is not Scheme.unquantized
        shards: list[ShardSource] = []
        for shard in spec.shards:
            sl = shard_slice(spec, shard, self.ckpt.dims, self.tp_size, self.tp_rank)
            w = self._info(f"{shard.checkpoint_prefix}.weight")
            self._expect_shape(w, (shard.rows, spec.input_size))
            self._expect_dtype(w, (FP8_DTYPE,) if quantized else FLOAT_DTYPES)
            weight_scale = input_scale = None
            if scheme is Scheme.fp8:
                weight_scale = f"{shard.checkpoint_prefix}.weight_scale"
                input_scale = f"{shard.checkpoint_prefix}.input_scale"
                self._scale(weight_scale, (), (1,))
                self._scale(input_scale, (), (1,))
            elif scheme is Scheme.fp8_pc_pt:
                weight_scale = f"{shard.checkpoint_prefix}.weight_scale"
                self._scale(weight_scale, (shard.rows,), (shard.rows, 1))
            bias = None
            if spec.has_bias:
                bias = f"{shard.checkpoint_prefix}.bias"
                info = self._info(bias)
                self._expect_dtype(info, FLOAT_DTYPES)
                self._expect_shape(info, (shard.rows,))
            shards.append(ShardSource(w.name, sl, weight_scale, input_scale, bias))
        return self._layout(spec, scheme, shards)

    def _layout(self, spec: LinearSpec, scheme: Scheme, shards: list[ShardSource]) -> LinearPlan:
        widths = [s.slice.width for s in shards]
        n, k = sum(widths), shards[0].slice.input_size
        weight_dtype = self.ckpt.tensors[shards[0].weight].dtype
        names = {t: f"{spec.prefix}.{t}" for t in ("weight", "weight_scale", "input_scale", "bias")}
        bias_spec = None
        if spec.has_bias:
            bias_dtype = self.ckpt.tensors[shards[0].bias or ""].dtype
            bias_spec = TensorSpec.contiguous(names["bias"], bias_dtype, (n,))
        if scheme is Scheme.unquantized:
            weight = TensorSpec.contiguous(names["weight"], weight_dtype, (n, k))
            layout = LayerLayout(
                name=spec.prefix,
                scheme=scheme,
                quant_algo=None,
                kernel=Kernel.none,
                format=WeightFormat.default,
                processed_weight_dims=None,
                input_size=k,
                padded_input_size=k,
                output_size=n,
                padded_output_size=n,
                logical_widths=widths,
                shard_names=[s.weight.rsplit(".", 1)[0] for s in shards],
                activation_quant=ActivationQuant.none,
                weight=weight.name,
                bias=bias_spec.name if bias_spec else None,
            )
            return LinearPlan(layout, tuple(shards), weight, None, None, bias_spec)

        n_pad, k_pad = weight_storage_shape(n, k)
        shape, stride = weight_view(n, k)
        weight = TensorSpec(names["weight"], FP8_DTYPE, (n_pad, k_pad), shape, stride)
        if scheme is Scheme.fp8:
            weight_scale = TensorSpec.contiguous(names["weight_scale"], torch.float32, ())
            input_scale: TensorSpec | None = TensorSpec.contiguous(
                names["input_scale"], torch.float32, ()
            )
            act = ActivationQuant.static_per_tensor
        else:
            weight_scale = TensorSpec.contiguous(
                names["weight_scale"], torch.float32, (pad_to_alignment(n),)
            )
            input_scale = None
            act = ActivationQuant.dynamic_per_token
        layout = LayerLayout(
            name=spec.prefix,
            scheme=scheme,
            quant_algo=self.algo,
            kernel=Kernel.cutlass,
            format=WeightFormat.default,
            processed_weight_dims=(0, 1),
            input_size=k,
            padded_input_size=k_pad,
            output_size=n,
            padded_output_size=n_pad,
            logical_widths=widths,
            shard_names=[s.weight.rsplit(".", 1)[0] for s in shards],
            activation_quant=act,
            weight_scale_shape=list(weight_scale.shape),
            input_scale_shape=list(input_scale.shape) if input_scale else None,
            weight=weight.name,
            weight_scale=weight_scale.name,
            input_scale=input_scale.name if input_scale else None,
            bias=bias_spec.name if bias_spec else None,
        )
        return LinearPlan(layout, tuple(shards), weight, weight_scale, input_scale, bias_spec)

    # --- everything else ----------------------------------------------------------------------

    def kv_scales(self) -> list[CarriedPlan]:
        carried = []
        for vllm_name, candidates in kv_scale_names(self.ckpt.dims).items():
            source = next((c for c in candidates if c in self.ckpt.tensors), None)
            if source is None:
                if self.ckpt.quant.kv_cache_quant_algo:
                    raise MissingTensorError(
                        "kv_cache_quant_algo is set but this KV scale is missing",
                        tensor=candidates[0],
                        file=str(self.ckpt.path),
                    )
                continue
            self._scale(source, (), (1,))
            spec = TensorSpec.contiguous(vllm_name, torch.float32, self.ckpt.tensors[source].shape)
            layout = CarriedLayout(name=vllm_name, kind=CarriedKind.checkpoint, source=source)
            carried.append(CarriedPlan(spec, layout))
        return carried

    def carried(self) -> list[CarriedPlan]:
        dims = self.ckpt.dims
        expected = {"model.embed_tokens.weight": (dims.vocab_size, dims.hidden_size)}
        if not dims.tie_word_embeddings or "lm_head.weight" in self.ckpt.tensors:
            expected["lm_head.weight"] = (dims.vocab_size, dims.hidden_size)
        for name, shape in expected.items():
            info = self._info(name)
            if info.dtype == FP8_DTYPE:
                raise UnsupportedQuantAlgoError(
                    "a quantized embedding or lm_head is not supported; exclude it from "
                    "quantization",
                    file=str(info.file),
                    tensor=name,
                )
            self._expect_dtype(info, FLOAT_DTYPES)
            self._expect_shape(info, shape)
        out = []
        for name, info in self.ckpt.tensors.items():
            if name in self.consumed and name not in expected:
                continue
            if name.endswith(SKIPPED_SUFFIXES):
                continue
            if info.dtype == FP8_DTYPE:
                raise TensorDtypeError(
                    "fp8 tensor that belongs to no quantized layer of this architecture",
                    file=str(info.file),
                    tensor=name,
                )
            if info.dtype not in FLOAT_DTYPES:
                raise TensorDtypeError(
                    f"dtype is {info.dtype}; a tensor carried as stored must be "
                    f"{' or '.join(str(d) for d in FLOAT_DTYPES)}",
                    file=str(info.file),
                    tensor=name,
                )
            out.append(self._carried_one(name, info))
        return out

    def _carried_one(self, name: str, info: TensorInfo) -> CarriedPlan:
        if name not in VOCAB_PARALLEL:
            spec = TensorSpec.contiguous(name, info.dtype, info.shape)
            return CarriedPlan(
                spec, CarriedLayout(name=name, kind=CarriedKind.replicated, source=name)
            )
        vocab = self.ckpt.dims.vocab_size
        per_rank, start, end = vocab_shard(vocab, self.tp_size, self.tp_rank)
        spec = TensorSpec.contiguous(name, info.dtype, (per_rank, info.shape[1]))
        layout = CarriedLayout(
            name=name,
            kind=CarriedKind.vocab_parallel,
            source=name,
            vocab_size=vocab,
            padding_size=VOCAB_PADDING_SIZE,
            vocab_start=start,
            vocab_end=end,
        )
        return CarriedPlan(spec, layout)


def plan_model(ckpt: Checkpoint, tp_size: int = 1, tp_rank: int = 0) -> ModelPlan:
    """Validate ``ckpt`` for rank ``tp_rank`` of ``tp_size`` and lay out what it will hold."""
    check_tp_size(ckpt.dims, tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} outside [0, {tp_size})")
    planner = _Planner(ckpt, tp_size, tp_rank)
    linears = [planner.linear(spec) for spec in linear_specs(ckpt.dims)]
    kv = planner.kv_scales()
    carried = planner.carried() + kv
    return ModelPlan(ckpt.quant.quant_algo, tp_size, tp_rank, linears, carried, planner.scales)
