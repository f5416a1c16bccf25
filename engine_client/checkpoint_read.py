"""The engine's own read of the checkpoint, for when it does not attach: read, process and place
the weights with the same ``modelopt_fp8`` code the daemon uses, so both paths give the same
bytes. :func:`attach_or_read` chooses between the two, never silently.

With ``fallback=True`` any reason not to attach (no daemon, model unknown or failed, a
verification failure, an arena that cannot be opened, any exception at all on the way) is
logged once, counted and returned (``engine_client/fallback.py``), as a
:class:`~protocol.reasons.Reason`, with the weights read from disk; with ``fallback=False`` it is
raised as a typed error.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from engine_client.attach import Attachment, attach_waiting
from engine_client.client import ClientConfig
from engine_client.fallback import fall_back_or_raise
from engine_client.verify import Expectations
from modelopt_fp8.checkpoint import Checkpoint
from modelopt_fp8.processing.execute import process_checkpoint
from modelopt_fp8.processing.plan import plan_model
from protocol.reasons import Reason
from protocol.schemas.layout import LayerLayout

__all__ = ["EngineWeights", "attach_or_read", "read_checkpoint"]


@dataclass
class EngineWeights:
    """The weights an engine ends up with, and where they came from."""

    tensors: dict[str, torch.Tensor]
    layers: list[LayerLayout]
    source: Literal["daemon", "disk"]
    reason: Reason | None  # why it did not attach (None when it did)
    seconds: float
    attachment: Attachment | None = None


def read_checkpoint(
    checkpoint: Path, device: torch.device, tp_rank: int = 0, tp_size: int = 1
) -> tuple[dict[str, torch.Tensor], list[LayerLayout]]:
    """The engine's own read: read, process and place this rank, as the daemon would."""
    with Checkpoint.open(checkpoint) as ckpt:
        plan = plan_model(ckpt, tp_size, tp_rank)
        return process_checkpoint(ckpt, plan, device), plan.layouts


def attach_or_read(
    model: str,
    checkpoint: Path,
    expect: Expectations,
    *,
    config: ClientConfig | None = None,
    fallback: bool = True,
    wait_s: float = 0.0,
) -> EngineWeights:
    """Attach to ``model`` in the daemon, else (with ``fallback``) read ``checkpoint``."""
    config = config or ClientConfig.from_env()
    start = time.perf_counter()
    try:
        attachment = attach_waiting(model, expect, config, wait_s)
    except Exception as exc:
        reason = fall_back_or_raise(
            exc, fallback, f"loading {checkpoint} from disk instead of attaching"
        )
        tensors, layers = read_checkpoint(checkpoint, expect.device, expect.tp_rank, expect.tp_size)
        return EngineWeights(tensors, layers, "disk", reason, time.perf_counter() - start)
    return EngineWeights(
        attachment.tensors,
        attachment.layers,
        "daemon",
        None,
        time.perf_counter() - start,
        attachment,
    )
