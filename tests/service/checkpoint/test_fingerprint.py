"""The fingerprint is the same for the same files and changes with configs or any header."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from service.checkpoint import Checkpoint, checkpoint_fingerprint
from tests.checkpoint_tools import rewrite_tensors


def test_stable_and_recomputable_from_files(tiny_fp8: Path, copy_of) -> None:
    copy = copy_of(tiny_fp8)
    with Checkpoint.open(tiny_fp8) as a, Checkpoint.open(copy) as b:
        assert a.fingerprint == b.fingerprint == checkpoint_fingerprint(copy)


def test_changes_with_config(tiny_fp8: Path, copy_of) -> None:
    copy = copy_of(tiny_fp8)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (copy / "config.json").write_text(json.dumps(cfg))
    assert checkpoint_fingerprint(copy) != checkpoint_fingerprint(tiny_fp8)


def test_changes_with_quant_config(tiny_fp8: Path, copy_of) -> None:
    copy = copy_of(tiny_fp8)
    (copy / "hf_quant_config.json").write_text((copy / "hf_quant_config.json").read_text() + " ")
    assert checkpoint_fingerprint(copy) != checkpoint_fingerprint(tiny_fp8)


def test_changes_with_any_header(tiny_fp8: Path, copy_of) -> None:
    copy = copy_of(tiny_fp8)
    rewrite_tensors(copy, lambda t: t.update({"extra.bias": torch.zeros(4)}))
    assert checkpoint_fingerprint(copy) != checkpoint_fingerprint(tiny_fp8)
