"""Checks a manifest must pass before any leased tensor is used.

Each failure is a :class:`~protocol.errors.VerificationError` whose ``reason`` says which check
failed, so a fallback can state exactly why the engine loaded from disk instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from modelopt_fp8.checkpoint import DEFAULT_TIER, Checkpoint, Fingerprint, IdentityTier
from modelopt_fp8.checkpoint.fingerprint import checkpoint_fingerprint
from modelopt_fp8.checkpoint.quant_config import QuantConfig
from modelopt_fp8.schemes import SCHEMES, scheme_named
from protocol.checksum import storage_checksum
from protocol.devices import Placement
from protocol.errors import VerificationError
from protocol.reasons import Reason
from protocol.schemas.layout import Kernel, WeightFormat
from protocol.schemas.leases import LeaseGrant
from protocol.schemas.manifest import CudaFdHandle, CudaIpcHandle, DeviceKind, Manifest
from protocol.version import PROTOCOL_VERSION

__all__ = ["EngineCheckpoint", "Expectations", "Reason", "verify_checksums", "verify_grant"]


@dataclass(frozen=True)
class Expectations:
    """What this engine would have built itself, to hold a lease against."""

    device: torch.device
    tp_rank: int = 0
    tp_size: int = 1
    kernel: str = Kernel.cutlass.value
    format: str = WeightFormat.default.value
    fingerprint: Fingerprint | None = None  # the engine's own copy, at the tier it chose
    quant: QuantConfig | None = None  # the engine's reading of its quantization config
    verify_checksums: bool = False
    # The schemes (by name) whose layers the engine takes pre-processed; it refuses the others.
    supported_schemes: frozenset[str] = field(
        default_factory=lambda: frozenset(scheme.name for scheme in SCHEMES)
    )

    @classmethod
    def for_checkpoint(
        cls,
        path: Path,
        device: torch.device,
        tier: IdentityTier = DEFAULT_TIER,
        **kw: Any,
    ) -> Expectations:
        """What an engine loading ``path`` expects, its identity read now."""
        return cls.for_identity(EngineCheckpoint.read(path, tier), device, **kw)

    @classmethod
    def for_identity(
        cls, identity: EngineCheckpoint, device: torch.device, **kw: Any
    ) -> Expectations:
        """What an engine expects of a lease for the checkpoint ``identity`` describes."""
        return cls(device, fingerprint=identity.fingerprint, quant=identity.quant, **kw)


@dataclass(frozen=True)
class EngineCheckpoint:
    """The engine's own copy of a checkpoint as a lease is checked against it: its identity at
    the tier the engine chose, and its quantization config."""

    fingerprint: Fingerprint
    quant: QuantConfig

    @classmethod
    def read(cls, path: Path, tier: IdentityTier = DEFAULT_TIER) -> EngineCheckpoint:
        """Read from the copy's files (``full`` reads every byte; the others cost milliseconds
        at most)."""
        with Checkpoint.open(path) as ckpt:
            if tier is IdentityTier.sampled:
                fingerprint = Fingerprint(tier, ckpt.fingerprint)
            else:
                fingerprint = checkpoint_fingerprint(path, tier)
            return cls(fingerprint, ckpt.quant)


def _fail(reason: Reason, detail: str, **extra: object) -> VerificationError:
    return VerificationError(detail, reason=reason, **extra)


def _check_identity(manifest: Manifest, mine: Fingerprint) -> None:
    tier = mine.tier.value
    leased = manifest.checkpoint.digests.of(tier)
    if mine.digest is None or leased is None:
        whose = "this engine's" if mine.digest is None else "the daemon's"
        raise _fail(
            Reason.fingerprint_mismatch,
            f"cannot compare checkpoints by {tier}: {whose} copy has no {tier} digest"
            + (" (not in a Hugging Face cache)" if mine.tier is IdentityTier.hf_blob else ""),
            tier=tier,
        )
    if leased != mine.digest:
        raise _fail(
            Reason.fingerprint_mismatch,
            f"lease is of checkpoint {leased} ({manifest.checkpoint.path}), the engine's is "
            f"{mine.digest} (tier {tier})",
            tier=tier,
            engine=mine.digest,
            leased=leased,
        )


def _check_device(manifest: Manifest, device: torch.device) -> None:
    leased = manifest.device
    kind = DeviceKind.cuda if device.type == "cuda" else DeviceKind.cpu
    if leased.kind is not kind:
        raise _fail(
            Reason.device_mismatch, f"lease is on {leased.kind.value}, engine on {kind.value}"
        )
    index = None
    if kind is DeviceKind.cuda:
        index = device.index if device.index is not None else torch.cuda.current_device()
    mine = Placement(kind, index).identity()
    if leased.uuid != mine.uuid:
        raise _fail(
            Reason.device_mismatch,
            f"lease is on {leased.uuid}, engine on {mine.uuid}",
            leased=leased.uuid,
            engine=mine.uuid,
        )
    if leased.compute_capability != mine.compute_capability:
        raise _fail(
            Reason.capability_mismatch,
            f"lease processed for sm {leased.compute_capability}, engine is "
            f"{mine.compute_capability}",
        )


def _check_layers(manifest: Manifest, expect: Expectations) -> None:
    for layer in manifest.layers:
        if layer.scheme not in expect.supported_schemes:
            raise _fail(
                Reason.unsupported_layer,
                f"{layer.name} is {layer.scheme}, which this engine cannot take pre-processed",
                layer=layer.name,
            )
        scheme_named(layer.scheme).check_leased(layer, expect.kernel, expect.format)
        mine = expect.quant.scheme_for(layer.name).name if expect.quant else layer.scheme
        if layer.scheme != mine:
            raise _fail(
                Reason.scheme_mismatch,
                f"{layer.name} is {layer.scheme} in the lease but {mine} for this engine",
                layer=layer.name,
            )


def verify_grant(grant: LeaseGrant, expect: Expectations) -> None:
    """Everything that can be checked before the arena is opened."""
    if grant.manifest is None:
        raise _fail(Reason.manifest_invalid, "the grant carries no manifest")
    manifest = grant.manifest
    if manifest.daemon.protocol_version != PROTOCOL_VERSION:
        raise _fail(
            Reason.protocol_version,
            f"daemon speaks protocol {manifest.daemon.protocol_version}, this engine "
            f"{PROTOCOL_VERSION}",
        )
    if (manifest.tp_rank, manifest.tp_size) != (expect.tp_rank, expect.tp_size):
        raise _fail(
            Reason.tp_mismatch,
            f"lease is rank {manifest.tp_rank}/{manifest.tp_size}, engine is "
            f"{expect.tp_rank}/{expect.tp_size}",
        )
    if expect.fingerprint is not None:
        _check_identity(manifest, expect.fingerprint)
    _check_device(manifest, expect.device)
    if expect.quant is not None and manifest.checkpoint.quant_algo != expect.quant.quant_algo:
        raise _fail(
            Reason.quant_algo_mismatch,
            f"lease is {manifest.checkpoint.quant_algo}, engine expects {expect.quant.quant_algo}",
        )
    _check_layers(manifest, expect)
    if [a.index for a in grant.arenas] != [0]:
        raise _fail(Reason.manifest_invalid, "a rank's tensors are served from one arena")
    size = grant.arenas[0].nbytes
    handle = grant.arenas[0].handle
    mapped = handle.tensor_size if isinstance(handle, CudaIpcHandle) else handle.size
    if mapped != size:
        raise _fail(Reason.manifest_invalid, f"the arena handle maps {mapped} bytes, not {size}")
    if isinstance(handle, CudaFdHandle) and handle.allocation_size < size:
        raise _fail(
            Reason.manifest_invalid,
            f"an allocation of {handle.allocation_size} bytes cannot hold an arena of {size}",
        )
    for t in manifest.tensors:
        if t.arena != 0 or t.offset < 0 or t.offset + t.nbytes > size:
            raise _fail(Reason.manifest_invalid, f"{t.name} lies outside its arena", tensor=t.name)


def verify_checksums(manifest: Manifest, storages: dict[str, torch.Tensor]) -> None:
    """Recompute every tensor's checksum over the mapped bytes (a full read of the arena)."""
    for t in manifest.tensors:
        got = storage_checksum(storages[t.name])
        if got != t.checksum:
            raise _fail(
                Reason.checksum_mismatch,
                f"{t.name} does not match its checksum",
                tensor=t.name,
                expected=t.checksum,
                got=got,
            )
