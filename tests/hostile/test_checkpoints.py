"""Broken and lying checkpoints: every one is refused with its code (none as internal_error),
cheaply (a config promising a million layers plans none of them), and ``/health`` keeps
answering."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from modelopt_fp8.checkpoint import Checkpoint
from protocol.errors import CorruptFileError, InvalidConfigError
from tests.checkpoint_tools import rewrite_header, rewrite_json, rewrite_tensors
from tests.hostile.conftest import Hostile
from tests.hostile.probe import HealthProbe


def _config(**values: object) -> Callable[[Path], None]:
    return lambda p: rewrite_json(p / "config.json", lambda c: c.update(values))


def _deep_config(p: Path) -> None:
    (p / "config.json").write_text("[" * 100_000 + "]" * 100_000)


def _deep_header(p: Path) -> None:
    f = p / "model.safetensors"
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    deep = b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    f.write_bytes(struct.pack("<Q", len(deep)) + deep + raw[8 + n :])


def _huge_config(p: Path) -> None:
    (p / "config.json").write_text(json.dumps({"pad": "x" * (17 * 1024 * 1024)}))


def _bool_tensor(p: Path) -> None:
    rewrite_tensors(p, lambda t: t.update({"model.extra_mask": torch.ones(4, dtype=torch.bool)}))


def _index(weight_map: object) -> Callable[[Path], None]:
    def write(p: Path) -> None:
        (p / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    return write


CASES: list[tuple[str, Callable[[Path], object], str]] = [
    ("layers-1e6", _config(num_hidden_layers=1_000_000), "invalid_config"),
    ("layers-1e8", _config(num_hidden_layers=100_000_000), "invalid_config"),
    ("hidden", _config(hidden_size=1_000_000_000, head_dim=8), "invalid_config"),
    ("vocab", _config(vocab_size=10**12), "invalid_config"),
    ("intermediate", _config(intermediate_size=3), "invalid_config"),
    ("heads", _config(num_attention_heads=64, head_dim=64), "invalid_config"),
    ("layers-str", _config(num_hidden_layers="2"), "invalid_config"),
    ("layers-bool", _config(num_hidden_layers=True), "invalid_config"),
    ("deep-config", _deep_config, "invalid_config"),
    ("huge-config", _huge_config, "invalid_config"),
    ("not-utf8", lambda p: (p / "config.json").write_bytes(b"\xff\xfe{}"), "invalid_config"),
    ("bool-tensor", _bool_tensor, "wrong_dtype"),
    ("deep-header", _deep_header, "corrupt_safetensors"),
    (
        "header-len",
        lambda p: (p / "model.safetensors").write_bytes(
            struct.pack("<Q", 2**63) + (p / "model.safetensors").read_bytes()[8:]
        ),
        "corrupt_safetensors",
    ),
    (
        "bad-dtype",
        lambda p: rewrite_header(
            p / "model.safetensors",
            lambda h: h["model.norm.weight"].update({"dtype": "Q" * 10_000}),
        ),
        "corrupt_safetensors",
    ),
    (
        "negative-shape",
        lambda p: rewrite_header(
            p / "model.safetensors", lambda h: h["model.norm.weight"].update({"shape": [-64]})
        ),
        "corrupt_safetensors",
    ),
    (
        "metadata",
        lambda p: rewrite_header(
            p / "model.safetensors", lambda h: h.update({"__metadata__": {"a": [1]}})
        ),
        "corrupt_safetensors",
    ),
    ("index-list", _index([1, 2]), "invalid_config"),
    ("index-escape", _index({"model.norm.weight": "../tiny/model.safetensors"}), "invalid_config"),
    ("index-missing", _index({"model.norm.weight": "nope.safetensors"}), "missing_tensor"),
    ("index-nul", _index({"model.norm.weight": "a\u0000b"}), "invalid_config"),
]


@pytest.mark.parametrize(("name", "mutate", "code"), CASES, ids=[c[0] for c in CASES])
def test_broken_checkpoint_is_refused_with_its_code(
    hostile: Hostile, name: str, mutate: Callable[[Path], object], code: str
) -> None:
    path = hostile.checkpoint(f"broken-{name}")
    mutate(path)
    with HealthProbe(hostile.url) as probe:
        r = hostile.load(path, f"broken-{name}")
        if r.status_code == 202:
            info = hostile.settled(f"broken-{name}")
            assert info["state"] == "failed"
            got = info["error"]["code"]
            hostile.unload(f"broken-{name}")
        else:
            got = r.json()["code"]
    assert got == code
    probe.assert_answered()


def test_a_lying_layer_count_is_refused_on_open(tiny_fp8: Path, copy_of) -> None:
    """The refusal comes from opening the checkpoint, before any plan could be made."""
    path = copy_of(tiny_fp8)
    _config(num_hidden_layers=10**9)(path)
    with pytest.raises(InvalidConfigError) as err:
        Checkpoint.open(path)
    assert err.value.extra["field"] == "num_hidden_layers"
    assert "headers hold 2 layers" in err.value.detail


def test_a_file_truncated_while_open_is_a_typed_error(tiny_fp8: Path, copy_of) -> None:
    """Reads go through the descriptor with pread: a file cut short under an open checkpoint
    gives corrupt_safetensors, never a SIGBUS that would kill the daemon."""
    path = copy_of(tiny_fp8)
    with Checkpoint.open(path) as ckpt:
        name = max(ckpt.tensors, key=lambda n: ckpt.tensors[n].offset)
        (path / "model.safetensors").write_bytes(b"")  # truncates the same inode
        with pytest.raises(CorruptFileError, match="ended"):
            ckpt.read(name)


def test_files_swapped_after_open_are_not_read(tiny_fp8: Path, copy_of) -> None:
    """What was opened is what is read: replacing the file by name afterwards changes
    nothing the open checkpoint returns."""
    path = copy_of(tiny_fp8)
    with Checkpoint.open(path) as ckpt:
        name = "model.norm.weight"
        before = ckpt.read(name).clone()
        (path / "model.safetensors").rename(path / "old.bin")
        (path / "model.safetensors").write_bytes(b"\0" * 64)
        assert torch.equal(ckpt.read(name), before)
