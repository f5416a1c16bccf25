"""What an engine start learns before it attaches: the checkpoint's identity (and a donated
model's key digests), read once, and the daemon's model for it.

vLLM's worker calls the loader twice per engine start, each time on a loader it builds afresh
(``get_model_loader`` makes one per call): ``get_external_weight_memory`` in the worker's
``init_device``, before the model runner opens its load window, then ``load_model`` inside it.
Both pass the same ``VllmConfig`` object, so the identity is kept for that object: the second
call reuses what the first read. A new engine start (a new config) reads it again.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from vllm.distributed import get_tensor_model_parallel_world_size

from engine_client.client import ClientConfig, DaemonClient
from engine_client.loader_options import LoaderOptions
from engine_client.verify import EngineCheckpoint
from modelopt_fp8.checkpoint import IdentityTier
from modelopt_fp8.checkpoint.fingerprint import checkpoint_fingerprint
from modelopt_fp8.checkpoint.locate import local_checkpoint as locate_local_checkpoint
from protocol.errors import ModelNotFoundError, VerificationError
from protocol.reasons import Reason
from protocol.schemas.models import ModelInfo, ModelState

__all__ = [
    "checkpoint_digests",
    "checkpoint_identity",
    "daemon_model",
    "local_checkpoint",
    "rank_bytes",
    "target_device",
]


def local_checkpoint(model_config: Any) -> Path:
    """The checkpoint directory vLLM loads: the directory itself, or a Hugging Face repo id vLLM
    reads from the local cache (as the daemon resolves its --model), at the revision vLLM was
    given. The loader serves local checkpoints only."""
    checkpoint = locate_local_checkpoint(
        model_config.model, getattr(model_config, "revision", None)
    )
    if checkpoint is None:
        raise VerificationError(
            f"{model_config.model} is neither a local checkpoint directory nor a Hugging Face "
            "repo in the local cache",
            reason=Reason.not_local_checkpoint,
        )
    return checkpoint


class _SameObject:
    """A cache key equal only to a key for the same object (compared by identity, not by
    value), which it keeps alive while cached so that its id is not reused."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _SameObject) and other.obj is self.obj


@functools.lru_cache(maxsize=1)
def _read_identity(
    engine_start: _SameObject, checkpoint: Path, tier: IdentityTier
) -> EngineCheckpoint:
    return EngineCheckpoint.read(checkpoint, tier)


def checkpoint_identity(
    vllm_config: Any, model_config: Any, tier: IdentityTier
) -> EngineCheckpoint:
    """The identity of the checkpoint this engine start loads, read from its files once per
    engine start (``vllm_config``); a failed read is not kept, so the load reads again and
    reports it."""
    return _read_identity(_SameObject(vllm_config), local_checkpoint(model_config), tier)


@functools.lru_cache(maxsize=1)
def _read_digests(
    engine_start: _SameObject, checkpoint: Path, tiers: tuple[IdentityTier, ...]
) -> dict[IdentityTier, str | None]:
    return {t: checkpoint_fingerprint(checkpoint, t).digest for t in tiers}


def checkpoint_digests(
    vllm_config: Any, checkpoint: Path, tiers: tuple[IdentityTier, ...]
) -> dict[IdentityTier, str | None]:
    """The checkpoint's digest at each of ``tiers`` (a donated model's key), read from its files
    once per engine start (``vllm_config``), as :func:`checkpoint_identity` is."""
    return _read_digests(_SameObject(vllm_config), checkpoint, tiers)


def daemon_model(
    config: ClientConfig, options: LoaderOptions, vllm_config: Any, model_config: Any
) -> ModelInfo:
    """The daemon's model for this engine, asked now: the one the ``model`` option names, else
    the ready (or loading) one whose digests match this engine start's checkpoint
    (:func:`checkpoint_identity`, read once) at this TP size."""
    tp_size = get_tensor_model_parallel_world_size()
    with DaemonClient(config) as client:
        models = client.models()
    if options.model:
        chosen = [m for m in models if m.id == options.model]
    else:
        tier = IdentityTier(options.identity)
        mine = checkpoint_identity(vllm_config, model_config, tier).fingerprint
        chosen = [
            m
            for m in models
            if mine.matches(m.digests)
            and m.state in (ModelState.ready, ModelState.loading)
            and m.tp_size == tp_size
            and m.donor is None  # a donated model is found by its key (.donation_load)
        ]
    if not chosen:
        raise ModelNotFoundError(
            f"the daemon holds no model for {model_config.model} at tp_size {tp_size}"
        )
    return chosen[0]


def rank_bytes(model: ModelInfo) -> int:
    """The bytes the daemon holds for one TP rank of ``model``."""
    return model.bytes_resident // max(1, model.tp_size)


def target_device(vllm_config: Any) -> torch.device:
    """The device vLLM loads onto (its load config's, else its device config's), with the
    current CUDA device made explicit."""
    load_device = vllm_config.load_config.device or vllm_config.device_config.device
    device = torch.device(load_device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device
