"""The engine's load policy: attach to the daemon's weights, or fall back to an ordinary load
through the same processing code, never silently.

With ``fallback=True`` any reason not to attach (no daemon, model unknown or failed, a
verification failure, a layout the engine cannot take) is logged, counted and returned with the
weights loaded from disk; with ``fallback=False`` it is raised.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from engine_client.attach import Attachment, attach
from engine_client.client import ClientConfig
from engine_client.verify import Expectations
from service.checkpoint import Checkpoint
from service.errors import ModelLoadingError, VerificationError, WeightCacheError
from service.processing import load_processed, plan_model
from service.schemas.layout import LayerLayout

log = logging.getLogger(__name__)

# Fallbacks by reason in this process (also exported to Prometheus where vLLM has it).
FALLBACKS: collections.Counter[str] = collections.Counter()


def _prometheus_counter() -> Any:
    try:
        from prometheus_client import Counter
    except ImportError:
        return None
    try:
        return Counter(
            "weight_cache_engine_fallbacks", "Engine loads that fell back to disk", ["reason"]
        )
    except ValueError:  # already registered in this process
        return None


_PROM = _prometheus_counter()


def fallback_reason(error: WeightCacheError) -> str:
    """The stated reason: a verification's own reason code, else the error's code."""
    return error.reason if isinstance(error, VerificationError) else error.code


def record_fallback(error: WeightCacheError, action: str) -> str:
    """Log, count and return the reason an engine is not attaching."""
    reason = fallback_reason(error)
    FALLBACKS[reason] += 1
    if _PROM is not None:
        _PROM.labels(reason=reason).inc()
    log.warning("weight-cache: %s (%s): %s", action, reason, error.detail)
    return reason


@dataclass
class LoadResult:
    tensors: dict[str, torch.Tensor]
    layers: list[LayerLayout]
    source: Literal["daemon", "disk"]
    reason: str | None  # why it did not attach (None when it did)
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
    except WeightCacheError as exc:
        if not fallback:
            raise
        reason = record_fallback(exc, f"loading {checkpoint} from disk instead of attaching")
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
