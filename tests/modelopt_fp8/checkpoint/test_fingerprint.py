"""Checkpoint identity tiers: each is the same for the same checkpoint and tells apart what its
tier promises to (another seed for ``sampled``, one byte for ``full``, a copy for ``files``)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

from harness.checkpoint_tools import rewrite_tensors
from modelopt_fp8.checkpoint import Checkpoint, IdentityTier, checkpoint_fingerprint
from modelopt_fp8.checkpoint.fingerprint import SAMPLE_BYTES, SAMPLE_WINDOWS, sample_windows
from protocol.errors import NotRegularFileError
from service.demo import write_demo_checkpoint


def digest(path: Path, tier: IdentityTier) -> str | None:
    return checkpoint_fingerprint(path, tier).digest


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two checkpoints of one architecture and shapes whose every tensor differs (a fine-tune,
    a re-export): ``demo-checkpoint A --seed 1`` and ``B --seed 2``."""
    root = tmp_path_factory.mktemp("seeds")
    return (
        write_demo_checkpoint(root / "a", "fp8", "tiny", seed=1),
        write_demo_checkpoint(root / "b", "fp8", "tiny", seed=2),
    )


def test_daemon_and_engine_compute_the_same_digests(tiny_fp8: Path) -> None:
    with Checkpoint.open(tiny_fp8) as ckpt:
        digests = ckpt.digests
        assert ckpt.fingerprint == digests.sampled
        assert ckpt.full_digest() == digest(tiny_fp8, IdentityTier.full)
    for tier in (IdentityTier.files, IdentityTier.sampled, IdentityTier.hf_blob):
        assert digests.of(tier.value) == digest(tiny_fp8, tier)


def test_a_byte_identical_copy_matches_except_by_files(tiny_fp8: Path, copy_of) -> None:
    copy = copy_of(tiny_fp8)
    for tier in (IdentityTier.sampled, IdentityTier.full):
        assert digest(copy, tier) == digest(tiny_fp8, tier)
    assert digest(copy, IdentityTier.files) != digest(tiny_fp8, IdentityTier.files)


def test_other_weights_same_shapes_differ_in_every_tier(seeds: tuple[Path, Path]) -> None:
    a, b = seeds
    with Checkpoint.open(a) as ca, Checkpoint.open(b) as cb:  # same layout, headers and configs
        assert {n: (t.dtype, t.shape) for n, t in ca.tensors.items()} == {
            n: (t.dtype, t.shape) for n, t in cb.tensors.items()
        }
    assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()
    for tier in (IdentityTier.files, IdentityTier.sampled, IdentityTier.full):
        assert digest(a, tier) != digest(b, tier), tier


def _unsampled_byte(path: Path) -> int:
    """A file offset in tensor data that no sample window of the file covers."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = (8 + n + o for o in entry["data_offsets"])
        if end - begin > 4 * SAMPLE_BYTES * SAMPLE_WINDOWS:
            covered = [(o, o + length) for o, length in sample_windows(begin, end)]
            for pos in range(begin, end):
                if not any(lo <= pos < hi for lo, hi in covered):
                    return pos
    raise AssertionError("no tensor large enough")


def test_one_changed_byte_needs_the_full_tier(tiny_fp8: Path, copy_of) -> None:
    copy = copy_of(tiny_fp8)
    path = copy / "model.safetensors"
    pos = _unsampled_byte(path)
    with path.open("r+b") as f:
        f.seek(pos)
        old = f.read(1)
        f.seek(pos)
        f.write(bytes([old[0] ^ 0x01]))
    assert digest(copy, IdentityTier.full) != digest(tiny_fp8, IdentityTier.full)
    # What the sampled tier does not promise: a byte outside its windows goes unseen.
    assert digest(copy, IdentityTier.sampled) == digest(tiny_fp8, IdentityTier.sampled)


def test_a_changed_byte_inside_a_window_changes_the_sampled_tier(tiny_fp8: Path, copy_of) -> None:
    copy = copy_of(tiny_fp8)
    rewrite_tensors(copy, lambda t: t["model.norm.weight"].__setitem__(0, 3.0))
    assert digest(copy, IdentityTier.sampled) != digest(tiny_fp8, IdentityTier.sampled)


def test_sampled_tier_changes_with_configs_and_headers(tiny_fp8: Path, copy_of) -> None:
    base = digest(tiny_fp8, IdentityTier.sampled)
    config = copy_of(tiny_fp8)
    cfg = json.loads((config / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (config / "config.json").write_text(json.dumps(cfg))
    assert digest(config, IdentityTier.sampled) != base
    quant = config.parent / "quant"
    shutil.copytree(tiny_fp8, quant)
    (quant / "hf_quant_config.json").write_text((quant / "hf_quant_config.json").read_text() + " ")
    assert digest(quant, IdentityTier.sampled) != base
    header = config.parent / "header"
    shutil.copytree(tiny_fp8, header)
    rewrite_tensors(header, lambda t: t.update({"extra.bias": torch.zeros(4)}))
    assert digest(header, IdentityTier.sampled) != base


def test_files_tier_follows_the_files_not_the_path(tiny_fp8: Path, tmp_path: Path, copy_of) -> None:
    """The same files under another path (as a bind mount shows them) match; touching one
    (a new mtime) does not."""
    link = tmp_path / "mounted"
    link.symlink_to(tiny_fp8, target_is_directory=True)
    assert digest(link, IdentityTier.files) == digest(tiny_fp8, IdentityTier.files)
    copy = copy_of(tiny_fp8)
    before = digest(copy, IdentityTier.files)
    st = os.stat(copy / "config.json")
    os.utime(copy / "config.json", ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert digest(copy, IdentityTier.files) != before


def _hf_cache(root: Path, checkpoint: Path, revision: str) -> Path:
    """``checkpoint`` laid out as a Hugging Face cache: blobs named by content hash, and a
    snapshot of links to them."""
    blobs, snapshot = root / "blobs", root / "snapshots" / revision
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for f in sorted(checkpoint.iterdir()):
        blob = blobs / hashlib.sha256(f.read_bytes()).hexdigest()
        if not blob.exists():
            shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def test_hf_blob_tier(tmp_path: Path, tiny_fp8: Path, seeds: tuple[Path, Path]) -> None:
    cache = tmp_path / "models--demo--tiny"
    first = _hf_cache(cache, tiny_fp8, "rev1")
    again = _hf_cache(cache, tiny_fp8, "rev2")  # same blobs under another revision
    other = _hf_cache(tmp_path / "models--demo--seed", seeds[0], "rev1")
    assert digest(first, IdentityTier.hf_blob) is not None
    assert digest(first, IdentityTier.hf_blob) == digest(again, IdentityTier.hf_blob)
    assert digest(other, IdentityTier.hf_blob) != digest(first, IdentityTier.hf_blob)
    assert digest(tiny_fp8, IdentityTier.hf_blob) is None  # not in a cache
    with Checkpoint.open(first) as ckpt:
        assert ckpt.digests.hf_blob == digest(first, IdentityTier.hf_blob)


def test_sample_windows_are_in_bounds_and_deterministic() -> None:
    assert sample_windows(100, 100) == []
    assert sample_windows(100, 164) == [(100, 64)]
    big = sample_windows(1000, 1000 + 10_000_000)
    assert big == sample_windows(1000, 1000 + 10_000_000)
    assert len(big) == SAMPLE_WINDOWS and big[0] == (1000, SAMPLE_BYTES)
    assert big[-1] == (1000 + 10_000_000 - SAMPLE_BYTES, SAMPLE_BYTES)
    assert all(o >= 1000 and o + n <= 1000 + 10_000_000 for o, n in big)
    assert sample_windows(2000, 2000 + 10_000_000) != [(o + 1000, n) for o, n in big]


@pytest.mark.parametrize("tier", [IdentityTier.sampled, IdentityTier.full])
def test_unreadable_files_are_a_typed_error(tiny_fp8: Path, copy_of, tier: IdentityTier) -> None:
    copy = copy_of(tiny_fp8)
    (copy / "model.safetensors").unlink()
    (copy / "model.safetensors").mkdir()  # listed, but not a regular file: refused on open
    with pytest.raises(NotRegularFileError):
        checkpoint_fingerprint(copy, tier)


def test_full_tier_is_a_hash_of_block_hashes(
    tiny_fp8: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks hashed in parallel give the digest the definition gives (every file's name and
    size, then each block's xxh3-128 in order), also when blocks end inside tensors; a changed
    byte in a middle block changes it."""
    import xxhash

    from modelopt_fp8.checkpoint import fingerprint

    monkeypatch.setattr(fingerprint, "FULL_BLOCK", 4096)
    files = fingerprint.identity_files(tiny_fp8, sorted(tiny_fp8.glob("*.safetensors")))
    want = xxhash.xxh3_128(fingerprint._DOMAIN + b"full\0" + (4096).to_bytes(8, "little"))
    for path in files:
        data = path.read_bytes()
        want.update(path.name.encode() + b"\0" + len(data).to_bytes(8, "little"))
        for offset in range(0, len(data), 4096):
            want.update(xxhash.xxh3_128_digest(data[offset : offset + 4096]))
    assert any(p.stat().st_size > 3 * 4096 for p in files)
    assert digest(tiny_fp8, IdentityTier.full) == "xxh3-128:" + want.hexdigest()
    with Checkpoint.open(tiny_fp8) as ckpt:  # the daemon's way: through its descriptors
        assert ckpt.full_digest() == "xxh3-128:" + want.hexdigest()


def test_full_tier_stops_when_asked(tiny_fp8: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A load cancelled while hashing stops at the next block, with every mapping closed."""
    from modelopt_fp8.checkpoint import fingerprint

    monkeypatch.setattr(fingerprint, "FULL_BLOCK", 4096)
    calls = 0

    class Cancelled(Exception):
        pass

    def between() -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise Cancelled

    with Checkpoint.open(tiny_fp8) as ckpt, pytest.raises(Cancelled):
        ckpt.full_digest(between)
    assert calls == 3


def test_digests_are_of_the_files_the_load_opened(tiny_fp8: Path, copy_of) -> None:
    """Names swapped after the checkpoint was opened and checked (another config, a copy of a
    weight file) change nothing in its digests: every tier reads what the load read, through
    its descriptors or as read, never the names again."""
    path = copy_of(tiny_fp8)
    tiers = (IdentityTier.files, IdentityTier.sampled, IdentityTier.full)
    before = {tier: digest(path, tier) for tier in tiers}
    with Checkpoint.open(path) as ckpt:
        config = json.loads((path / "config.json").read_text())
        config["rope_theta"] = 1234.0
        (path / "config.json.new").write_text(json.dumps(config))
        os.replace(path / "config.json.new", path / "config.json")
        shutil.copy(path / "model.safetensors", path / "model.safetensors.new")
        os.replace(path / "model.safetensors.new", path / "model.safetensors")
        assert ckpt.digests.files == before[IdentityTier.files]
        assert ckpt.digests.sampled == before[IdentityTier.sampled]
        assert ckpt.full_digest() == before[IdentityTier.full]
    # What a fresh reader of the names now sees differs.
    assert digest(path, IdentityTier.files) != before[IdentityTier.files]
    assert digest(path, IdentityTier.sampled) != before[IdentityTier.sampled]
