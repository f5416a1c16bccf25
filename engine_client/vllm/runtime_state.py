"""Runtime state: what vLLM's constructors compute rather than load (rotary caches, the attention
layers' scale buffers and host copies, KV-cache scale parameters). A model built on the meta
device holds none of it, so it is built on the target device by vLLM's own code, and the
checkpoint's KV-cache scales go through vLLM's weight loaders. Afterwards nothing may be left on
the meta device."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine_client.attach import Attachment
from engine_client.vllm.internals import (
    has_meta_attention_scales,
    has_meta_rotary_cache,
    is_meta,
    rebuild_attention_state,
    rebuild_rotary_cache,
)
from protocol.errors import VerificationError
from protocol.reasons import Reason

__all__ = ["build_runtime_state", "load_checkpoint_scales", "meta_tensors", "require_materialized"]


def build_runtime_state(model: nn.Module, device: torch.device) -> None:
    """Build, on ``device`` and with vLLM's own code, the tensors its constructors compute
    rather than load; everything else must already be bound."""
    with torch.device(device):
        for module in model.modules():
            if has_meta_rotary_cache(module):
                rebuild_rotary_cache(module)
            if has_meta_attention_scales(module):
                rebuild_attention_state(module)


def load_checkpoint_scales(model: Any, attachment: Attachment, names: list[str]) -> None:
    """Give the leased tensors vLLM keeps as the checkpoint holds them (the KV-cache scales) to
    the model's own ``load_weights`` (every vLLM model class has one), as vLLM's default
    loader would."""
    model.load_weights((name, attachment.tensors[name]) for name in names)


def meta_tensors(model: nn.Module) -> list[str]:
    """Names of every parameter, buffer or tensor attribute still on the meta device."""
    left: list[str] = []
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for key, value in vars(module).items():
            if key in ("_parameters", "_buffers"):
                found = [k for k, v in value.items() if is_meta(v)]
            else:
                found = [key] if is_meta(value) else []
            left.extend(prefix + k for k in found)
    return left


def require_materialized(model: nn.Module) -> None:
    """Refuse a model that still holds meta tensors: the lease or vLLM's constructors would
    have had to provide them, so this vLLM built something this loader does not serve."""
    left = meta_tensors(model)
    if left:
        shown = ", ".join(left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
        raise VerificationError(
            f"the lease and vLLM's constructors leave {shown} unset",
            reason=Reason.unsupported_module,
        )
