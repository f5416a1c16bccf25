"""Opening checkpoints: real exports, sharded files, and every broken-file refusal naming its
file."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from harness.checkpoint_tools import rewrite_header
from modelopt_fp8.checkpoint import Checkpoint
from protocol.errors import (
    CheckpointNotFoundError,
    CorruptFileError,
    InvalidConfigError,
    MissingTensorError,
    NotModelOptCheckpointError,
)
from service.demo import write_demo_checkpoint
from tests.conftest import MODELOPT_EXPORTS


@pytest.mark.parametrize("export", MODELOPT_EXPORTS, ids=lambda p: p.name)
def test_real_exports_open(export: Path) -> None:
    with Checkpoint.open(export) as ckpt:
        assert ckpt.quant.quant_algo in ("FP8", "FP8_PER_CHANNEL_PER_TOKEN")
        assert ckpt.quant.exclude_modules == ("lm_head", "model.embed_tokens")
        assert ckpt.dims.num_hidden_layers == 2
        assert ckpt.fingerprint.startswith("sha256:")
        assert "model.layers.0.self_attn.q_proj.weight" in ckpt.tensors


def test_sharded_checkpoint_reads_like_single_file(tmp_path: Path) -> None:
    single = write_demo_checkpoint(tmp_path / "one", "fp8", "tiny")
    sharded = write_demo_checkpoint(tmp_path / "many", "fp8", "tiny", shard_bytes=16_000)
    assert (sharded / "model.safetensors.index.json").is_file()
    with Checkpoint.open(single) as a, Checkpoint.open(sharded) as b:
        assert len(b.files) > 2
        assert a.tensors.keys() == b.tensors.keys()
        for name in a.tensors:
            assert torch.equal(
                a.read(name).reshape(-1).view(torch.uint8),
                b.read(name).reshape(-1).view(torch.uint8),
            ), name


def test_missing_directory_and_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError):
        Checkpoint.open(tmp_path / "nope")
    with pytest.raises(CheckpointNotFoundError, match=r"config\.json"):
        Checkpoint.open(tmp_path)


def test_unparseable_config(tiny_fp8: Path, copy_of) -> None:
    path = copy_of(tiny_fp8)
    (path / "config.json").write_text("{")
    with pytest.raises(InvalidConfigError) as err:
        Checkpoint.open(path)
    assert err.value.extra["file"].endswith("config.json")


def test_plain_bf16_checkpoint_is_not_modelopt(tiny_fp8: Path, copy_of) -> None:
    path = copy_of(tiny_fp8)
    (path / "hf_quant_config.json").unlink()
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(NotModelOptCheckpointError):
        Checkpoint.open(path)


def test_truncated_file(tiny_fp8: Path, copy_of) -> None:
    path = copy_of(tiny_fp8)
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CorruptFileError) as err:
        Checkpoint.open(path)
    assert err.value.extra["file"] == str(f)


def test_header_lying_about_offsets(tiny_fp8: Path, copy_of) -> None:
    path = copy_of(tiny_fp8)

    def lie(header: dict) -> None:
        entry = header["model.layers.0.self_attn.q_proj.weight"]
        start, end = entry["data_offsets"]
        entry["data_offsets"] = [start, end + 64]

    rewrite_header(path / "model.safetensors", lie)
    with pytest.raises(CorruptFileError, match="offset"):
        Checkpoint.open(path)


def test_header_lying_about_shape(tiny_fp8: Path, copy_of) -> None:
    path = copy_of(tiny_fp8)

    def lie(header: dict) -> None:
        header["model.layers.0.self_attn.q_proj.weight"]["shape"] = [64, 65]

    rewrite_header(path / "model.safetensors", lie)
    with pytest.raises(CorruptFileError):
        Checkpoint.open(path)


def test_huge_header_length(tiny_fp8: Path, copy_of) -> None:
    path = copy_of(tiny_fp8)
    f = path / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(struct.pack("<Q", 2**60) + raw[8:])
    with pytest.raises(CorruptFileError, match="header"):
        Checkpoint.open(path)


def test_garbage_file(tiny_fp8: Path, copy_of) -> None:
    path = copy_of(tiny_fp8)
    (path / "model.safetensors").write_bytes(b"\x00" * 3)
    with pytest.raises(CorruptFileError):
        Checkpoint.open(path)


def test_index_naming_a_missing_shard(tmp_path: Path) -> None:
    path = write_demo_checkpoint(tmp_path / "c", "fp8", "tiny", shard_bytes=16_000)
    sorted(path.glob("model-*.safetensors"))[-1].unlink()
    with pytest.raises(MissingTensorError, match="does not exist"):
        Checkpoint.open(path)


def test_index_lying_about_placement(tmp_path: Path) -> None:
    path = write_demo_checkpoint(tmp_path / "c", "fp8", "tiny", shard_bytes=16_000)
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    files = sorted(set(index["weight_map"].values()))
    name = next(k for k, v in index["weight_map"].items() if v == files[0])
    index["weight_map"][name] = files[1]
    index_path.write_text(json.dumps(index))
    with pytest.raises(MissingTensorError) as err:
        Checkpoint.open(path)
    assert err.value.extra["tensor"] == name


def test_index_escaping_the_directory(tmp_path: Path) -> None:
    path = write_demo_checkpoint(tmp_path / "c", "fp8", "tiny", shard_bytes=16_000)
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../../etc/passwd"
    index_path.write_text(json.dumps(index))
    with pytest.raises(InvalidConfigError, match="outside the checkpoint"):
        Checkpoint.open(path)


def test_read_into_and_parallel_reads(tiny_fp8: Path) -> None:
    """Reads are preads on descriptors opened once: straight into caller memory, and safe
    from several threads at once."""
    from concurrent.futures import ThreadPoolExecutor

    with Checkpoint.open(tiny_fp8) as ckpt:
        names = sorted(ckpt.tensors)
        for name in names:
            info = ckpt.tensors[name]
            out = torch.empty(info.shape, dtype=info.dtype)
            ckpt.read_into(name, out)
            assert torch.equal(
                out.reshape(-1).view(torch.uint8), ckpt.read(name).reshape(-1).view(torch.uint8)
            )
        q = "model.layers.0.self_attn.q_proj.weight"
        rows = torch.empty((8, ckpt.tensors[q].shape[1]), dtype=ckpt.tensors[q].dtype)
        ckpt.read_into(q, rows, rows=(8, 16))
        assert torch.equal(rows.view(torch.uint8), ckpt.read(q)[8:16].view(torch.uint8))
        with pytest.raises(ValueError, match="bytes"):
            ckpt.read_into(q, torch.empty(3, dtype=torch.uint8))
        with ThreadPoolExecutor(4) as pool:
            together = list(
                pool.map(lambda n: ckpt.read(n).reshape(-1).view(torch.uint8), names * 4)
            )
        for i, name in enumerate(names * 4):
            assert torch.equal(together[i], ckpt.read(name).reshape(-1).view(torch.uint8))
