"""Donating one rank to the daemon, and finding a donated one: the calls, the copy into the
offered arena, and the comparison of keys. Nothing here knows vLLM (``engine_client/vllm/
donated.py`` captures and binds a vLLM model's state).

A donation is one copy: every tensor's storage span is written into the daemon's arena (host
shared memory, or a shareable allocation on the donor's GPU, copied there on the GPU; the handle
socket passes it to the donor mapped read-write), its checksum taken over the bytes written, and
the offer committed; the donor then leases its own
donation and points its tensors into it (:func:`engine_client.vllm.donated.bind_donated`), so
its own copy is freed. A failed copy abandons the offer, so the daemon keeps nothing half
written.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from engine_client.answers import parse_answer, parse_answers
from engine_client.arenas import open_arena
from engine_client.client import ApiCall, ClientConfig, DaemonClient
from protocol.checksum import checking_s, storage_checksum
from protocol.dtypes import to_wire
from protocol.errors import VerificationError, WeightCacheError
from protocol.logsafe import get_logger
from protocol.reasons import Reason
from protocol.schemas.donated import DonatedState, DonationKey
from protocol.schemas.donations import (
    DonatedTensorSpec,
    DonationCommit,
    DonationInfo,
    DonationOffer,
    DonationRequest,
)
from protocol.schemas.manifest import ArenaDescriptor, TensorEntry
from protocol.schemas.models import ModelInfo, ModelState

log = get_logger(__name__)

# What an engine logs of its donated load (``engine_client/vllm/donation_load.py``), defined once:
# the restart proof reads them from an engine's output (``tests/gpu/donation_lines.py``).
DONATED_LOG = "weight-cache: donated %s (%d tensors)"
ATTACHED_LOG = "weight-cache: attached donated model %s (%d tensors)"

_donated_here: list[int] = []  # the bytes of each arena this process filled and committed


def bytes_donated_here() -> int:
    """The bytes this process gave the daemon: its weights, held since in the daemon's
    allocation. A donor sizing its KV cache counts them as its own, as vLLM's default loader
    would hold them (an attacher is charged for what it maps by ``get_external_weight_memory``;
    a donor, which found nothing to map, by this)."""
    return sum(_donated_here)


# --- the calls --------------------------------------------------------------------------------


def list_call() -> ApiCall[list[DonationInfo]]:
    return ApiCall("GET", "/v1/donations", lambda r: parse_answers(DonationInfo, r.content))


def offer_call(request: DonationRequest) -> ApiCall[DonationOffer]:
    read = lambda r: parse_answer(DonationOffer, r.content)  # noqa: E731
    body = request.model_dump(mode="json")
    return ApiCall("POST", "/v1/donations", read, idempotent=False, json=body)


def commit_call(model: str, commit: DonationCommit, timeout_s: float) -> ApiCall[ModelInfo]:
    """The commit, answered once the daemon has checked every byte against its checksum:
    ``timeout_s`` plus the longest that check may take (gigabytes; the client's own timeout
    would give up on a large model while the daemon still checks it)."""
    read = lambda r: parse_answer(ModelInfo, r.content)  # noqa: E731
    body = commit.model_dump(mode="json")
    nbytes = sum(entry.nbytes for entry in commit.tensors)
    deadline = timeout_s + checking_s(nbytes)
    path = f"/v1/donations/{model}/commit"
    return ApiCall("POST", path, read, idempotent=False, json=body, timeout_s=deadline)


def abandon_call(model: str, secret: str) -> ApiCall[None]:
    body = {"secret": secret}
    return ApiCall("POST", f"/v1/donations/{model}/abandon", lambda r: None, json=body)


# --- finding one ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Found:
    """The donated model for a key (``model``), else the fields in which the closest donation
    of the same checkpoint differs (``differs``; empty: none of this checkpoint)."""

    model: str | None
    differs: list[str]
    pending: bool = False  # an equal key is being donated right now


def find_donation(config: ClientConfig, key: DonationKey) -> Found:
    """The daemon's donated model whose key equals ``key`` in every compared field."""
    with DaemonClient(config) as client:
        donations = client.send(list_call())
    same_checkpoint: list[list[str]] = []
    for info in donations:
        differs = key.differences(info.key)
        if not differs:
            if info.state is ModelState.ready:
                return Found(info.model, [])
            return Found(None, [], pending=True)
        if info.key.sampled == key.sampled:
            same_checkpoint.append(differs)
    closest = min(same_checkpoint, key=len, default=[])
    return Found(None, closest)


def donated_bytes(config: ClientConfig, known: Mapping[str, object]) -> int:
    """The bytes of the daemon's ready donated model whose key agrees with ``known`` on every
    compared field it names (0: none)."""
    compared = {k: v for k, v in known.items() if k not in DonationKey.COMPARED_EXCLUDE}
    with DaemonClient(config) as client:
        donations = client.send(list_call())
        matching = {
            info.model
            for info in donations
            if info.state is ModelState.ready
            and all(getattr(info.key, k) == v for k, v in compared.items())
        }
        if not matching:
            return 0
        models = client.models()
    return max((m.bytes_resident for m in models if m.id in matching), default=0)


# --- the copy ---------------------------------------------------------------------------------


def storage_span(tensor: torch.Tensor) -> torch.Tensor:
    """The contiguous 1-D run of ``tensor``'s storage from its first element to its last (what
    its shape and stride reach), as its dtype: a view, no copy."""
    if tensor.numel() == 0:
        return tensor.detach().reshape(-1)[:0]
    last = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    return tensor.detach().as_strided((last + 1,), (1,), tensor.storage_offset())


def donated_specs(tensors: Mapping[str, torch.Tensor]) -> list[DonatedTensorSpec]:
    """What the offer must size: each tensor's span and dtype (a dtype no manifest carries is
    refused by name)."""
    specs = []
    for name, tensor in tensors.items():
        try:
            wire = to_wire(tensor.dtype)
        except ValueError as exc:
            raise VerificationError(
                f"{name} is {tensor.dtype}, which a manifest cannot carry",
                reason=Reason.donation_unsupported,
                tensor=name,
            ) from exc
        span = storage_span(tensor)
        specs.append(
            DonatedTensorSpec(name=name, dtype=wire, nbytes=span.numel() * span.element_size())
        )
    return specs


def _write(
    offer: DonationOffer, tensors: Mapping[str, torch.Tensor], handle_socket: str | None
) -> list[TensorEntry]:
    """Copy every tensor's span into the offered arena, mapped read-write (host shared memory,
    or a shareable allocation on this engine's GPU: a copy on the GPU, or from the host for the
    few tensors vLLM keeps there), and describe it."""
    descriptor = ArenaDescriptor(index=0, nbytes=offer.nbytes, handle=offer.handle)
    opened = open_arena(descriptor, offer.model, handle_socket, writable=True)
    base = opened.base
    assert base is not None
    try:
        if base.numel() < offer.nbytes:
            raise VerificationError(
                f"the offered arena holds {base.numel()} bytes, not {offer.nbytes}",
                reason=Reason.donation_refused,
            )
        entries = []
        for name, tensor in tensors.items():
            if tensor.device not in (base.device, torch.device("cpu")):
                raise VerificationError(
                    f"{name} is on {tensor.device}, the arena on {base.device}: an attacher "
                    "would get it on another device",
                    reason=Reason.donation_unsupported,
                    tensor=name,
                )
            span = storage_span(tensor)
            nbytes = span.numel() * span.element_size()
            offset = offer.offsets[name]
            target = base[offset : offset + nbytes]
            if nbytes:
                target.copy_(span.reshape(-1).view(torch.uint8))
            entries.append(
                TensorEntry(
                    name=name,
                    arena=0,
                    offset=offset,
                    nbytes=nbytes,
                    dtype=to_wire(tensor.dtype),
                    shape=list(tensor.shape),
                    stride=list(tensor.stride()),
                    checksum=storage_checksum(target),
                )
            )
        if base.is_cuda:  # every copy done before the daemon reads them at the commit
            torch.cuda.synchronize(base.device)
        return entries
    finally:
        del base
        opened.close()  # unmapped once the last view is gone


def donate(
    config: ClientConfig,
    key: DonationKey,
    tensors: Mapping[str, torch.Tensor],
    state: DonatedState,
) -> str:
    """Give the daemon ``tensors`` (by name, one per tensor object; on the CPU, or on the GPU
    the key names and the host) under ``key`` with ``state``; returns the donated model's id."""
    request = DonationRequest(key=key, tensors=donated_specs(tensors), client_pid=os.getpid())
    with DaemonClient(config) as client:
        offer = client.send(offer_call(request))
        try:
            entries = _write(offer, tensors, config.handle_socket)
            client.send(
                commit_call(
                    offer.model,
                    DonationCommit(secret=offer.secret, tensors=entries, state=state),
                    config.timeout_s,
                )
            )
            _donated_here.append(offer.nbytes)
        except BaseException:
            try:
                client.send(abandon_call(offer.model, offer.secret))
            except WeightCacheError as exc:
                log.warning("abandoning donation %s: %s", offer.model, exc)
            raise
    return offer.model
