"""Every reason ``verify_grant`` (and ``verify_checksums``) can give, one row each, against a real
grant from a real daemon that is changed in exactly one place per row."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_client.client import ClientConfig, DaemonClient
from engine_client.verify import Expectations, verify_checksums, verify_grant
from harness.daemon_process import start_daemon
from modelopt_fp8.checkpoint import Fingerprint, IdentityTier
from modelopt_fp8.checkpoint.quant_config import QuantConfig
from protocol.errors import VerificationError
from protocol.reasons import Reason
from protocol.schemas.leases import LeaseGrant
from protocol.schemas.manifest import Manifest

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def grant(tmp_path_factory: pytest.TempPathFactory, tiny_fp8: Path) -> Iterator[LeaseGrant]:
    daemon = start_daemon(tmp_path_factory.mktemp("verify"), [tiny_fp8], "--model-id", "tiny")
    try:
        with DaemonClient(ClientConfig(url=daemon.url)) as client:
            granted = client.lease("tiny")
            client.release(granted.lease.id)
        yield granted
    finally:
        daemon.stop()


@pytest.fixture(scope="module")
def expect(tiny_fp8: Path) -> Expectations:
    return Expectations.for_checkpoint(tiny_fp8, CPU)


def manifest_of(g: LeaseGrant) -> Manifest:
    assert g.manifest is not None
    return g.manifest


def with_manifest(**update: Any) -> Callable[[LeaseGrant], LeaseGrant]:
    def change(g: LeaseGrant) -> LeaseGrant:
        return g.model_copy(update={"manifest": manifest_of(g).model_copy(update=update)})

    return change


def with_nested(field: str, **update: Any) -> Callable[[LeaseGrant], LeaseGrant]:
    """The manifest's ``field`` (daemon, device, checkpoint) with ``update`` applied."""

    def change(g: LeaseGrant) -> LeaseGrant:
        inner = getattr(manifest_of(g), field).model_copy(update=update)
        return with_manifest(**{field: inner})(g)

    return change


def with_digests(**update: Any) -> Callable[[LeaseGrant], LeaseGrant]:
    def change(g: LeaseGrant) -> LeaseGrant:
        checkpoint = manifest_of(g).checkpoint
        digests = checkpoint.digests.model_copy(update=update)
        return with_nested("checkpoint", digests=digests)(g)

    return change


def with_first_fp8_layer(**update: Any) -> Callable[[LeaseGrant], LeaseGrant]:
    def change(g: LeaseGrant) -> LeaseGrant:
        layers = list(manifest_of(g).layers)
        i = next(i for i, la in enumerate(layers) if la.scheme != "unquantized")
        layers[i] = layers[i].model_copy(update=update)
        return with_manifest(layers=layers)(g)

    return change


def with_last_tensor(**update: Any) -> Callable[[LeaseGrant], LeaseGrant]:
    def change(g: LeaseGrant) -> LeaseGrant:
        tensors = list(manifest_of(g).tensors)
        tensors[-1] = tensors[-1].model_copy(update=update)
        return with_manifest(tensors=tensors)(g)

    return change


def with_arena(**update: Any) -> Callable[[LeaseGrant], LeaseGrant]:
    def change(g: LeaseGrant) -> LeaseGrant:
        return g.model_copy(update={"arenas": [g.arenas[0].model_copy(update=update)]})

    return change


def without_manifest(g: LeaseGrant) -> LeaseGrant:
    return g.model_copy(update={"manifest": None})


def same(g: LeaseGrant) -> LeaseGrant:
    return g


OTHER = "sha256:" + "0" * 64
PC_PT = QuantConfig("FP8_PER_CHANNEL_PER_TOKEN", None, (), "x")
EXCLUDING_DOWN = QuantConfig("FP8", None, ("model.layers.1.mlp.down_proj",), "x")

# (id, change to the grant, change to the expectations, reason)
CASES: list[tuple[str, Callable[[LeaseGrant], LeaseGrant], dict[str, Any], Reason]] = [
    ("protocol_version", with_nested("daemon", protocol_version=99), {}, Reason.protocol_version),
    ("tp_rank", same, {"tp_rank": 1, "tp_size": 2}, Reason.tp_mismatch),
    ("tp_size", with_manifest(tp_size=2), {}, Reason.tp_mismatch),
    (
        "fingerprint_sampled",
        same,
        {"fingerprint": Fingerprint(IdentityTier.sampled, OTHER)},
        Reason.fingerprint_mismatch,
    ),
    ("fingerprint_sampled_leased", with_digests(sampled=OTHER), {}, Reason.fingerprint_mismatch),
    (
        "fingerprint_files",
        same,
        {"fingerprint": Fingerprint(IdentityTier.files, OTHER)},
        Reason.fingerprint_mismatch,
    ),
    (
        "fingerprint_full",
        same,
        {"fingerprint": Fingerprint(IdentityTier.full, "xxh3-128:" + "0" * 32)},
        Reason.fingerprint_mismatch,
    ),
    (
        "fingerprint_full_not_computed",
        with_digests(full=None),
        {"fingerprint": Fingerprint(IdentityTier.full, "xxh3-128:" + "1" * 32)},
        Reason.fingerprint_mismatch,
    ),
    (
        "fingerprint_hf_blob_engine_not_in_cache",
        with_digests(hf_blob=OTHER),
        {"fingerprint": Fingerprint(IdentityTier.hf_blob, None)},
        Reason.fingerprint_mismatch,
    ),
    (
        "fingerprint_hf_blob_daemon_not_in_cache",
        same,
        {"fingerprint": Fingerprint(IdentityTier.hf_blob, OTHER)},
        Reason.fingerprint_mismatch,
    ),
    ("device_kind", same, {"device": torch.device("cuda", 0)}, Reason.device_mismatch),
    ("device_uuid", with_nested("device", uuid="host-other"), {}, Reason.device_mismatch),
    (
        "capability",
        with_nested("device", compute_capability="9.0"),
        {},
        Reason.capability_mismatch,
    ),
    ("quant_algo", same, {"quant": PC_PT}, Reason.quant_algo_mismatch),
    ("scheme", same, {"quant": EXCLUDING_DOWN}, Reason.scheme_mismatch),
    (
        "unsupported_layer",
        same,
        {"supported_schemes": frozenset({"unquantized"})},
        Reason.unsupported_layer,
    ),
    ("unknown_scheme", with_first_fp8_layer(scheme="fp8_block"), {}, Reason.unsupported_layer),
    ("kernel", same, {"kernel": "marlin"}, Reason.kernel_mismatch),
    ("format", same, {"format": "marlin_repacked"}, Reason.format_mismatch),
    (
        "weight_view",
        with_first_fp8_layer(processed_weight_dims=(1, 0)),
        {},
        Reason.manifest_invalid,
    ),
    ("no_manifest", without_manifest, {}, Reason.manifest_invalid),
    ("arena_index", with_arena(index=1), {}, Reason.manifest_invalid),
    ("tensor_past_arena_end", with_last_tensor(offset=1 << 40), {}, Reason.manifest_invalid),
    ("tensor_negative_offset", with_last_tensor(offset=-256), {}, Reason.manifest_invalid),
    ("tensor_other_arena", with_last_tensor(arena=1), {}, Reason.manifest_invalid),
    ("handle_size", with_arena(nbytes=1 << 20), {}, Reason.manifest_invalid),
]


@pytest.mark.parametrize(
    ("change", "over", "reason"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_each_reason(
    grant: LeaseGrant,
    expect: Expectations,
    change: Callable[[LeaseGrant], LeaseGrant],
    over: dict[str, Any],
    reason: Reason,
) -> None:
    verify_grant(grant, expect)  # the unchanged grant passes
    with pytest.raises(VerificationError) as err:
        verify_grant(change(grant), dataclasses.replace(expect, **over))
    assert err.value.reason is reason
    if reason is Reason.fingerprint_mismatch:
        tier = (over.get("fingerprint") or expect.fingerprint).tier  # type: ignore[union-attr]
        assert err.value.extra["tier"] == tier.value and tier.value in err.value.detail


def test_every_verification_reason_has_a_row() -> None:
    verification = {
        Reason.protocol_version,
        Reason.tp_mismatch,
        Reason.fingerprint_mismatch,
        Reason.device_mismatch,
        Reason.capability_mismatch,
        Reason.quant_algo_mismatch,
        Reason.scheme_mismatch,
        Reason.unsupported_layer,
        Reason.kernel_mismatch,
        Reason.format_mismatch,
        Reason.manifest_invalid,
    }
    assert {c[3] for c in CASES} == verification


def test_every_tier_of_the_engine_matches_the_daemon(grant: LeaseGrant, tiny_fp8: Path) -> None:
    """The same copy passes at every tier but hf_blob (not in a Hugging Face cache)."""
    for tier in (IdentityTier.files, IdentityTier.sampled, IdentityTier.full):
        verify_grant(grant, Expectations.for_checkpoint(tiny_fp8, CPU, tier))


def test_checksum_mismatch(grant: LeaseGrant) -> None:
    manifest = manifest_of(grant)
    storages = {t.name: torch.zeros(t.nbytes, dtype=torch.uint8) for t in manifest.tensors}
    with pytest.raises(VerificationError) as err:
        verify_checksums(manifest, storages)
    assert err.value.reason is Reason.checksum_mismatch
    assert err.value.extra["tensor"] == manifest.tensors[0].name
