"""The engine's load policy: attach to the daemon's weights, or fall back to an ordinary load
through the same processing code, never silently.

With ``fallback=True`` any reason not to attach (no daemon, model unknown or failed, a
verification failure, an arena that cannot be opened, any exception at all on the way) is
logged once, counted and returned, as a :class:`~protocol.reasons.Reason`, with the weights
loaded from disk; with ``fallback=False`` it is raised as a typed error.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from engine_client.attach import Attachment, attach
from engine_client.client import ClientConfig
from engine_client.fallback import FALLBACKS, as_weight_cache_error, reason_of, record_fallback
from engine_client.verify import Expectations
from modelopt_fp8.checkpoint import Checkpoint
from modelopt_fp8.processing import load_processed, plan_model
from protocol.errors import ModelLoadingError
from protocol.reasons import Reason
from protocol.schemas.layout import LayerLayout

__all__ = [
    "FALLBACKS",
    "LoadResult",
    "attach_waiting",
    "load_from_disk",
    "load_weights",
    "reason_of",
    "record_fallback",
]

log = logging.getLogger(__name__)


@dataclass
class LoadResult:
    tensors: dict[str, torch.Tensor]
    layers: list[LayerLayout]
    source: Literal["daemon", "disk"]
    reason: Reason | None  # why it did not attach (None when it did)
    seconds: float
    attachment: Attachment | None = None


def load_from_disk(
    checkpoint: Path, device: torch.device, tp_rank: int = 0, tp_size: int = 1
) -> tuple[dict[str, torch.Tensor], list[LayerLayout]]:
    """An ordinary load: read, process and place, as the daemon would."""
    with Checkpoint.open(checkpoint) as ckpt:
        plan = plan_model(ckpt, tp_size, tp_rank)
        return load_processed(ckpt, plan, device), plan.layouts


def attach_waiting(
    model: str, expect: Expectations, config: ClientConfig, wait_s: float = 0.0
) -> Attachment:
    """``attach``, retrying while the daemon reports the model still loading (up to wait_s)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return attach(model, expect, config=config)
        except ModelLoadingError as exc:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            pause = min(float(exc.extra.get("retry_after_s", 1)), left, 5.0)
            log.info("%s is still loading in the daemon; retrying in %.1f s", model, pause)
            time.sleep(pause)


def load_weights(
    model: str,
    checkpoint: Path,
    expect: Expectations,
    *,
    config: ClientConfig | None = None,
    fallback: bool = True,
    wait_s: float = 0.0,
) -> LoadResult:
    """Attach to ``model`` in the daemon, else (with ``fallback``) load ``checkpoint``."""
    config = config or ClientConfig.from_env()
    start = time.perf_counter()
    try:
        attachment = attach_waiting(model, expect, config, wait_s)
    except Exception as exc:
        error = as_weight_cache_error(exc)
        if not fallback:
            if error is exc:
                raise
            raise error from exc
        reason = record_fallback(error, f"loading {checkpoint} from disk instead of attaching")
        tensors, layers = load_from_disk(checkpoint, expect.device, expect.tp_rank, expect.tp_size)
        return LoadResult(tensors, layers, "disk", reason, time.perf_counter() - start)
    return LoadResult(
        attachment.tensors,
        attachment.layers,
        "daemon",
        None,
        time.perf_counter() - start,
        attachment,
    )
