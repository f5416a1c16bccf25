"""Processing checkpoints for vLLM's CUTLASS FP8 kernel, byte-identical to vLLM 0.33."""

from modelopt_fp8.processing.execute import execute_plan, process_checkpoint
from modelopt_fp8.processing.plan import (
    CarriedPlan,
    LinearPlan,
    ModelPlan,
    ShardSource,
    TensorSpec,
    plan_model,
)

__all__ = [
    "CarriedPlan",
    "LinearPlan",
    "ModelPlan",
    "ShardSource",
    "TensorSpec",
    "execute_plan",
    "plan_model",
    "process_checkpoint",
]
