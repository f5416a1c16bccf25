"""What a quantization scheme defines: one interface, :class:`LinearScheme`, for everything that
differs between the kinds of linear layer the cache serves.

A scheme says how a linear layer of its kind is read, processed, checked and bound, from the
checkpoint's quantization config to the tensors vLLM's module holds:

* **quant config**: the ModelOpt ``quant_algo`` it serves (``quant_algo``; ``None`` for the layers
  the config leaves unquantized);
* **planning**: the dtype the checkpoint's weight has (``weight_dtypes``), the scale tensors each
  shard carries and their shapes (:meth:`LinearScheme.shard_scales`), and the processed tensors and
  :class:`~protocol.schemas.layout.LayerLayout` of the fused layer (:meth:`LinearScheme.lay_out`);
* **filling**: the fused scales and the code map that requantizes each shard's weight rows
  (:meth:`LinearScheme.scale_fills`), which the fast path carries out;
* **the reference**: the same processing in plain torch on whole tensors
  (:meth:`LinearScheme.process_in_torch`), which the fast path is compared with byte for byte and
  the benchmarks' plain loader runs;
* **the engine**: what it checks of a leased layer before using it
  (:meth:`LinearScheme.check_leased`), the scale parameters it binds
  (:meth:`LinearScheme.bound_scales`) and whether vLLM's kernel state is set
  (``sets_kernel_state``);
* **the demo writer**: how a weight is quantized and named as ModelOpt exports it
  (:meth:`LinearScheme.export`).

Schemes import only ``protocol`` and the processing's building blocks (tensor specs, row fills,
FP8 arithmetic, the CUTLASS layout), never the checkpoint reader or the planner: the checkpoint's
quantization config asks the registry which algorithms are served.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from modelopt_fp8.processing.fp8 import CodeMap
from modelopt_fp8.processing.rows import SmallFill
from modelopt_fp8.processing.tensor_spec import TensorSpec
from protocol.schemas.layout import LayerLayout, WeightFormat


class ScaleReads(Protocol):
    """The planner's checked reads, as far as a scheme uses them."""

    def scale(self, name: str, *shapes: tuple[int, ...]) -> torch.Tensor:
        """The float32 scale ``name`` of one of ``shapes``, read, checked and kept."""
        ...


@dataclass(frozen=True)
class ScaleNames:
    """The scale tensors one checkpoint shard carries (none for an unquantized one)."""

    weight_scale: str | None = None
    input_scale: str | None = None


@dataclass(frozen=True)
class ShardScales:
    """One shard's scales as planning read them, and the rows of the shard this rank holds."""

    weight_scale: torch.Tensor | None
    input_scale: torch.Tensor | None
    rows: tuple[int, int]


@dataclass(frozen=True)
class FusedLayer:
    """A linear layer on one rank as the planner hands it to its scheme: the fused shards' widths
    and the parts of its layout every scheme shares."""

    name: str  # vLLM's module name
    widths: tuple[int, ...]  # each fused shard's rows on this rank
    input_size: int  # K of this rank's shard
    weight_dtype: torch.dtype  # the checkpoint's weight dtype
    quant_algo: str  # the checkpoint's
    shard_names: tuple[str, ...]
    bias: str | None  # the fused bias' tensor name

    @property
    def output_size(self) -> int:
        return sum(self.widths)

    def tensor(self, leaf: str) -> str:
        """The name of the layer's tensor ``leaf`` (``weight``, ``weight_scale``...)."""
        return f"{self.name}.{leaf}"

    def layout(self, scheme: str, **fields: Any) -> LayerLayout:
        """The layer's layout: what every scheme shares, with the scheme's own ``fields``."""
        return LayerLayout(
            name=self.name,
            scheme=scheme,
            format=WeightFormat.default,
            input_size=self.input_size,
            output_size=self.output_size,
            logical_widths=list(self.widths),
            shard_names=list(self.shard_names),
            weight=self.tensor("weight"),
            bias=self.bias,
            **fields,
        )


@dataclass(frozen=True)
class LaidOut:
    """The processed tensors of a layer (the bias aside: every scheme keeps it as stored) and
    its layout."""

    layout: LayerLayout
    weight: TensorSpec
    weight_scale: TensorSpec | None = None
    input_scale: TensorSpec | None = None


@dataclass(frozen=True)
class TorchLayer:
    """A layer as the plain-torch processing hands it to its scheme: each shard's weight rows
    (views of the fused weight, requantized in place), its scales, and the storages of the fused
    scales to write (None where the scheme has none)."""

    weights: Sequence[torch.Tensor]
    shards: Sequence[ShardScales]
    weight_scale: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None


@dataclass(frozen=True)
class ScaleFills:
    """What a scheme computes for the fast path: the fused scales, and per shard the code map
    that requantizes its weight rows (None: its bytes stay as they are)."""

    fills: tuple[SmallFill, ...]
    code_maps: tuple[CodeMap | None, ...]


class LinearScheme(abc.ABC):
    """One kind of linear layer (see the module's docstring for what each part is for)."""

    name: ClassVar[str]  # the manifest's word for it (``LayerLayout.scheme``)
    quant_algo: ClassVar[str | None]  # ModelOpt's quant_algo it serves; None: excluded layers
    weight_dtypes: ClassVar[tuple[torch.dtype, ...]]  # what the checkpoint's weight may be
    sets_kernel_state: ClassVar[bool]  # the engine sets vLLM's processed-kernel state

    @property
    def demo_name(self) -> str:
        """The demo writer's name for it (``fp8-pc-pt``)."""
        return self.name.replace("_", "-")

    # --- planning -------------------------------------------------------------------------------

    @abc.abstractmethod
    def shard_scales(self, reads: ScaleReads, prefix: str, rows: int) -> ScaleNames:
        """Read and check the scales of the checkpoint shard ``prefix`` (``rows`` output rows)."""

    @abc.abstractmethod
    def lay_out(self, layer: FusedLayer) -> LaidOut:
        """The processed tensors and layout vLLM leaves on ``layer`` after loading."""

    # --- processing -----------------------------------------------------------------------------

    @abc.abstractmethod
    def scale_fills(self, laid: LaidOut, shards: Sequence[ShardScales]) -> ScaleFills:
        """The fused scales of ``laid`` and each shard's requantization, for the fast path."""

    @abc.abstractmethod
    def process_in_torch(self, layer: TorchLayer) -> None:
        """The same processing in plain torch: requantize each shard's weight rows in place and
        write the fused scales."""

    # --- the engine -----------------------------------------------------------------------------

    @abc.abstractmethod
    def check_leased(self, layer: LayerLayout, kernel: str, format: str) -> None:
        """Refuse (:class:`~protocol.errors.VerificationError`) a leased layer this engine,
        which selected ``kernel`` and ``format``, cannot use as it is."""

    @abc.abstractmethod
    def bound_scales(self, layer: LayerLayout) -> dict[str, str | None]:
        """The module's scale parameters the engine binds, each to its leased tensor's name
        (None: the parameter is removed)."""

    # --- the demo writer ------------------------------------------------------------------------

    @abc.abstractmethod
    def export(
        self, prefix: str, weight: torch.Tensor, input_scale: float
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """A shard's tensors as ModelOpt exports them, from its float ``weight`` and the input
        scale its fused layer shares."""
