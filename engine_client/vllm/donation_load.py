"""The load of a checkpoint the daemon does not process: attach to the donated model whose key
equals this engine's, else load with vLLM's default loader and donate.

1. **key**: the model is built on the meta device (no weight memory) to learn what vLLM picks
   (quant methods, kernels); with the checkpoint's identity, vLLM, dtypes, device and TP rank
   that is this rank's :class:`~protocol.schemas.donated.DonationKey`.
2. **attach**: a ready donated model with an equal key is leased and bound onto the meta model
   (:func:`.donated.bind_donated`): the engine never holds a copy of its own.
3. **donate**: otherwise the meta build is undone, vLLM's default load runs (build, load,
   process), and its state is given to the daemon (:func:`engine_client.donations.donate`:
   into host shared memory on the CPU, on a GPU into a shareable allocation of the daemon's on
   this GPU, copied there on the GPU); the engine then leases its own donation and binds it over
   its tensors, which frees them (:func:`give_back_own_copy`). A
   donated model of the same checkpoint whose key differs is named in the log with the fields
   that differ; a donation the daemon refuses (or processing this loader cannot hand over)
   leaves the engine on its own load, with the reason.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

from engine_client.attach import Attachment, attach
from engine_client.client import ClientConfig
from engine_client.donations import (
    ATTACHED_LOG,
    DONATED_LOG,
    Found,
    donate,
    donated_bytes,
    find_donation,
)
from engine_client.fallback import OWN_LOAD, own_failure_after, record_fallback
from engine_client.loader_options import LoaderOptions
from engine_client.verify import Expectations
from engine_client.vllm.donated import (
    bind_donated,
    capture,
    donation_key,
    known_fields,
    processed_load,
)
from engine_client.vllm.engine_start import local_checkpoint
from engine_client.vllm.internals import forget_build_on_error
from protocol.errors import (
    NotModelOptCheckpointError,
    UnsupportedQuantAlgoError,
    VerificationError,
    WeightCacheError,
)
from protocol.logsafe import get_logger
from protocol.reasons import Reason
from protocol.schemas.donated import DONATED_KERNEL, DonationKey

__all__ = [
    "DonatedLoad",
    "LoadInputs",
    "attach_or_donate",
    "donated_rank_bytes",
    "donates",
    "give_back_own_copy",
]

log = get_logger(__name__)


@dataclass
class DonatedLoad:
    """What the load did: the model, the lease it holds (None: on its own weights), whether it
    donated, and why it did not share where it did not."""

    model: nn.Module
    attachment: Attachment | None
    donated: str | None = None
    reason: Reason | None = None
    error: WeightCacheError | None = None  # why it did not share, where it did not


def give_back_own_copy(device: torch.device) -> None:
    """Free the donor's own tensors, unreferenced once its model holds the arena's views: on a
    GPU torch's caching allocator keeps freed blocks until emptied. Under ``--enable-sleep-mode``
    the load runs in a pool of vLLM's ``CuMemAllocator`` (tag ``weights``), which vLLM trims of
    its wholly free segments itself when the load's pool ends (``CuMemAllocator.use_memory_pool``);
    what vLLM allocates there in between may keep a part of a segment (the GPU test bounds what
    the donor holds)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def donated_rank_bytes(
    vllm_config: Any, model_config: Any, config: ClientConfig, device: torch.device
) -> int:
    """The bytes of the ready donated model this engine start will attach to (its key agrees in
    every field known before the model is built), which vLLM budgets as memory held outside the
    engine; 0 where there is none (an engine that donates counts what it gave as its own use:
    :func:`engine_client.vllm.startup.counted_as_own`)."""
    known = known_fields(
        vllm_config,
        model_config,
        local_checkpoint(model_config),
        device,
        get_tensor_model_parallel_rank(),
        get_tensor_model_parallel_world_size(),
    )
    return donated_bytes(config, known)


def donates(exc: Exception, options: LoaderOptions) -> bool:
    """Whether a load whose ModelOpt attach failed with ``exc`` goes the donated way: a
    checkpoint the daemon does not process (not a ModelOpt export, or a quantization it does not
    serve), unless the ``donate`` option is off; any checkpoint where ``donate`` is on."""
    if options.donate is not None:
        return options.donate
    return isinstance(exc, (NotModelOptCheckpointError, UnsupportedQuantAlgoError))


@dataclass(frozen=True)
class LoadInputs:
    """What the load step hands this load: vLLM's configs, how to build and fill the model (the
    steps of vLLM's default loader), how to reach the daemon, and the target device. One
    object, as both ways of the load (attach or donate) take all of it."""

    vllm_config: Any
    model_config: Any
    create_model: Callable[[], nn.Module]
    load_weights: Callable[[nn.Module], None]
    config: ClientConfig
    device: torch.device


class _NoDonation(Exception):
    """Undoes the meta build: no donated model with this key."""

    def __init__(self, key: DonationKey, found: Found) -> None:
        super().__init__(key.digest())
        self.key, self.found = key, found


def _lease(
    config: ClientConfig, model_id: str, device: torch.device, key: DonationKey
) -> Attachment:
    expect = Expectations(
        device, tp_rank=0, tp_size=1, kernel=DONATED_KERNEL, supported_schemes=frozenset()
    )
    attachment = attach(model_id, expect, config=config)
    donation = attachment.manifest.donation
    differs = key.differences(donation.key) if donation is not None else ["donation"]
    if differs:
        attachment.close()
        raise VerificationError(
            f"the donated model {model_id} differs from this engine in {', '.join(differs)}",
            reason=Reason.donation_differs,
            fields=differs,
        )
    return attachment


def _bound(
    model: nn.Module, config: ClientConfig, model_id: str, device: torch.device, key: DonationKey
) -> Attachment:
    """``model`` holding the donated model ``model_id``, leased (given back if binding fails)."""
    attachment = _lease(config, model_id, device, key)
    try:
        bind_donated(model, attachment, device)
    except BaseException:
        attachment.close()
        raise
    return attachment


def attach_or_donate(load: LoadInputs, fallback: bool) -> DonatedLoad:
    """Attach to this rank's donated model, else load and donate it (see the module); where the
    daemon cannot be asked (down, say), load without donating and say why (with ``fallback``
    off, raise why)."""
    checkpoint = local_checkpoint(load.model_config)
    rank, size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    try:
        with forget_build_on_error(load.vllm_config):
            with torch.device("meta"):
                model = load.create_model()
            key = donation_key(
                load.vllm_config, load.model_config, model, checkpoint, load.device, rank, size
            )
            found = find_donation(load.config, key)
            if found.model is None:
                raise _NoDonation(key, found)
            attachment = _bound(model, load.config, found.model, load.device, key)
    except _NoDonation as no_donation:
        missing: _NoDonation | WeightCacheError = no_donation.with_traceback(None)
    except WeightCacheError as exc:
        missing = exc.with_traceback(None)
    else:
        log.info(ATTACHED_LOG, found.model, len(attachment.tensors))
        return DonatedLoad(model, attachment)
    # Outside the ``except``: what vLLM's own load raises is not chained onto why there was no
    # donation to attach.
    if isinstance(missing, WeightCacheError):
        if not fallback:
            raise missing
        reason = record_fallback(missing, OWN_LOAD)
        with own_failure_after(reason):
            model, _ = processed_load(
                load.create_model, load.load_weights, load.model_config, load.device
            )
        return DonatedLoad(model, None, reason=reason, error=missing)
    return _load_and_donate(load, missing)


def _load_and_donate(load: LoadInputs, missing: _NoDonation) -> DonatedLoad:
    config, device = load.config, load.device
    model, before = processed_load(load.create_model, load.load_weights, load.model_config, device)
    found = missing.found
    if found.pending:
        error: WeightCacheError = VerificationError(
            "another engine is donating this rank right now", reason=Reason.donation_refused
        )
        reason = record_fallback(error, OWN_LOAD)
        return DonatedLoad(model, None, reason=reason, error=error)
    if found.differs:
        log.warning(
            "weight-cache: a donated model of this checkpoint differs in %s: donating this "
            "engine's own",
            ", ".join(found.differs),
        )
    try:
        state, tensors = capture(model, before, device)
        try:
            model_id = donate(config, missing.key, tensors, state)
        except VerificationError:
            raise
        except WeightCacheError as exc:
            raise VerificationError(
                f"the daemon refused the donation: {exc}",
                reason=Reason.donation_refused,
                refused=exc.code,
            ) from exc
        del tensors
        attachment = _bound(model, config, model_id, device, missing.key)
    except WeightCacheError as exc:
        reason = record_fallback(exc, OWN_LOAD)
        return DonatedLoad(model, None, reason=reason, error=exc)
    give_back_own_copy(device)
    log.info(DONATED_LOG, model_id, len(attachment.tensors))
    return DonatedLoad(model, attachment, donated=model_id)
