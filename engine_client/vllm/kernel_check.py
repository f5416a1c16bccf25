"""The kernel check: the daemon processes FP8 layers for vLLM's CUTLASS scaled-mm kernel, so
every FP8 linear layer of the model vLLM built must have selected that kernel too (on another
platform or GPU vLLM selects another, whose layout the lease does not hold)."""

from __future__ import annotations

from typing import Any

from torch import nn

from engine_client.vllm.internals import engine_kernel
from protocol.errors import VerificationError
from protocol.reasons import Reason
from protocol.schemas.layout import Kernel


def require_cutlass(model: nn.Module) -> None:
    """Refuse a model whose FP8 layers vLLM gave another kernel than the daemon processed for."""
    kernels = {engine_kernel(m) for m in model.modules()} - {None, Kernel.cutlass.value}
    if kernels:
        raise VerificationError(
            f"vLLM selected {', '.join(sorted(k for k in kernels if k))} for this model; the "
            "daemon processed for cutlass",
            reason=Reason.kernel_mismatch,
        )


def cutlass_layers(model: nn.Module) -> list[Any]:
    """The model's linear layers on the CUTLASS kernel: the ones a lease binds processed."""
    return [m for m in model.modules() if engine_kernel(m) == Kernel.cutlass.value]
