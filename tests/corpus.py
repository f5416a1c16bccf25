"""A corpus of broken checkpoints, each made from a good one by one kind of damage, with the
error code the daemon must answer with."""

from __future__ import annotations

import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import torch

from harness.checkpoint_tools import rewrite_header, rewrite_json, rewrite_tensors

Q = "model.layers.0.self_attn.q_proj"


def _truncate(d: Path) -> None:
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-4096])


def _lying_offsets(d: Path) -> None:
    def edit(h: dict) -> None:
        a, b = h[f"{Q}.weight"]["data_offsets"]
        h[f"{Q}.weight"]["data_offsets"] = [a + 8, b + 8]

    rewrite_header(d / "model.safetensors", edit)


def _huge_header(d: Path) -> None:
    f = d / "model.safetensors"
    f.write_bytes(struct.pack("<Q", 2**62) + f.read_bytes()[8:])


def _scale(value: float) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        rewrite_tensors(
            d, lambda t: t.update({f"{Q}.weight_scale": torch.tensor(value, dtype=torch.float32)})
        )

    return damage


def _wrong_dtype(d: Path) -> None:
    rewrite_tensors(d, lambda t: t.update({f"{Q}.weight": t[f"{Q}.weight"].float()}))


def _missing(d: Path) -> None:
    def edit(t: dict[str, torch.Tensor]) -> None:
        del t[f"{Q}.input_scale"]

    rewrite_tensors(d, edit)


def _algo(algo: str) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        rewrite_json(d / "config.json", lambda c: c["quantization_config"].update(quant_algo=algo))
        rewrite_json(
            d / "hf_quant_config.json", lambda c: c["quantization"].update(quant_algo=algo)
        )

    return damage


def _not_modelopt(d: Path) -> None:
    (d / "hf_quant_config.json").unlink()
    rewrite_json(d / "config.json", lambda c: c.pop("quantization_config"))


def _nan_weights(d: Path) -> None:
    def edit(t: dict[str, torch.Tensor]) -> None:
        w = t["model.layers.1.mlp.down_proj.weight"].clone()
        w.view(torch.uint8)[5, 5] = 0xFF
        t["model.layers.1.mlp.down_proj.weight"] = w

    rewrite_tensors(d, edit)


CORPUS: dict[str, tuple[Callable[[Path], None], str]] = {
    "truncated": (_truncate, "corrupt_safetensors"),
    "lying-offsets": (_lying_offsets, "corrupt_safetensors"),
    "huge-header": (_huge_header, "corrupt_safetensors"),
    "wrong-dtype": (_wrong_dtype, "wrong_dtype"),
    "nan-scale": (_scale(float("nan")), "invalid_scale"),
    "zero-scale": (_scale(0.0), "invalid_scale"),
    "negative-scale": (_scale(-0.5), "invalid_scale"),
    "missing-tensor": (_missing, "missing_tensor"),
    "nvfp4": (_algo("NVFP4"), "unsupported_quant_algo"),
    "block-fp8": (_algo("FP8_PB_WO"), "unsupported_quant_algo"),
    "not-modelopt": (_not_modelopt, "not_modelopt_checkpoint"),
    "nan-weights": (_nan_weights, "corrupt_safetensors"),
}


def make_broken(good: Path, root: Path, kind: str) -> Path:
    path = root / kind
    shutil.copytree(good, path)
    CORPUS[kind][0](path)
    return path
