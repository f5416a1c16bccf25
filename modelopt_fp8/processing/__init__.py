"""Processing checkpoints for vLLM's CUTLASS FP8 kernel, byte-identical to vLLM 0.33."""

from modelopt_fp8.processing.carried_plan import CarriedPlan
from modelopt_fp8.processing.execute import execute_plan, process_checkpoint
from modelopt_fp8.processing.linear_plan import LinearPlan, ShardSource
from modelopt_fp8.processing.plan import ModelPlan, plan_model
from modelopt_fp8.processing.tensor_spec import TensorSpec

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
