"""Helpers to break checkpoints in tests: rewrite tensors or configs of a copied checkpoint."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file


def rewrite_tensors(directory: Path, mutate: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Load every tensor of the single-file checkpoint, let ``mutate`` edit the dict, save."""
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    mutate(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def rewrite_json(path: Path, mutate: Callable[[dict[str, Any]], None]) -> None:
    data = json.loads(path.read_text())
    mutate(data)
    path.write_text(json.dumps(data, indent=2))


def rewrite_header(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit a safetensors file's JSON header in place, leaving its data bytes as they are."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    data = json.dumps(header).encode()
    data += b" " * (-len(data) % 8)
    path.write_bytes(struct.pack("<Q", len(data)) + data + raw[8 + n :])


def all_tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def hub_snapshot(
    hub: Path, repo_id: str, source: Path | None = None, revision: str = "0123abcd"
) -> Path:
    """What huggingface_hub leaves in the cache ``hub`` (``HF_HUB_CACHE``, or ``HF_HOME``'s
    ``hub``) after a download of ``repo_id``: a snapshot of ``source`` (else a bare
    config.json) and the ref ``main`` naming it."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    if source is None:
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text("{}")
    else:
        shutil.copytree(source, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def many_layers(path: Path, config_from: Path, layers: int) -> Path:
    """A checkpoint of ``layers`` layers holding one zero-size tensor each (config.json says
    so), about 90 bytes of header per layer."""
    path.mkdir(parents=True, exist_ok=True)
    config = json.loads((config_from / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (path / "config.json").write_text(json.dumps(config))
    shutil.copyfile(config_from / "hf_quant_config.json", path / "hf_quant_config.json")
    entries = b",".join(
        b'"model.layers.%d.input_layernorm.weight":{"dtype":"BF16","shape":[0],'
        b'"data_offsets":[0,0]}' % i
        for i in range(layers)
    )
    header = b"{" + entries + b"}"
    header += b" " * (-len(header) % 8)
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return path


def hollow_layers(path: Path, config_from: Path, layers: int) -> Path:
    """A checkpoint of ``layers`` layers whose every linear weight is named, each of zero size:
    it passes every count, so it is parsed in full before its sizes are found wrong."""
    from modelopt_fp8.checkpoint.architecture import layer_weight_names, read_dims

    path.mkdir(parents=True, exist_ok=True)
    config = json.loads((config_from / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (path / "config.json").write_text(json.dumps(config))
    shutil.copyfile(config_from / "hf_quant_config.json", path / "hf_quant_config.json")
    dims = read_dims(config, "config.json")
    entries = b",".join(
        b'"%s":{"dtype":"F8_E4M3","shape":[0,0],"data_offsets":[0,0]}' % name.encode()
        for i in range(layers)
        for name in layer_weight_names(dims, i)
    )
    header = b"{" + entries + b"}"
    header += b" " * (-len(header) % 8)
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return path
