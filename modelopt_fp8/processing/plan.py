"""The processing plan: every tensor one TP rank of a model will hold, with its size and layout,
worked out from headers and scales alone.

Planning is where a checkpoint is judged: missing tensors, wrong dtypes, shapes that disagree with
config.json and bad scales are all refused here, before a byte of the arena is allocated, so a
refused model leaves nothing half-built behind. The linear layers are planned first
(``linear_plan``); what they leave is carried (``carried_plan``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from modelopt_fp8.checkpoint import Checkpoint
from modelopt_fp8.checkpoint.architecture import layer_linear_specs
from modelopt_fp8.processing.carried_plan import CarriedPlan, plan_carried, plan_kv_scales
from modelopt_fp8.processing.checked_reads import CheckedReads
from modelopt_fp8.processing.linear_plan import LinearPlan, plan_linear
from modelopt_fp8.processing.tensor_parallel import check_tp_size
from modelopt_fp8.processing.tensor_spec import TensorSpec
from protocol.schemas.layout import CarriedLayout, LayerLayout


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


def plan_model(ckpt: Checkpoint, tp_size: int = 1, tp_rank: int = 0) -> ModelPlan:
    """Validate ``ckpt`` for rank ``tp_rank`` of ``tp_size`` and lay out what it will hold."""
    check_tp_size(ckpt.dims, tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} outside [0, {tp_size})")
    reads = CheckedReads(ckpt)
    # Layer by layer: a layer that fails stops the planning before the next one's specs exist.
    linears = [
        plan_linear(reads, spec, tp_size, tp_rank)
        for i in range(ckpt.dims.num_hidden_layers)
        for spec in layer_linear_specs(ckpt.dims, i)
    ]
    kv = plan_kv_scales(reads)
    carried = plan_carried(reads, tp_size, tp_rank) + kv
    return ModelPlan(ckpt.quant.quant_algo, tp_size, tp_rank, linears, carried, reads.scales)
