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


def dequantized(src: Path, dst: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """``src`` (a per-tensor ModelOpt FP8 export) as a plain checkpoint of ``dtype``: each FP8
    weight times its scale, the activation and KV-cache scales dropped, no quantization config.
    A checkpoint the daemon does not process, which vLLM loads with its default loader."""
    dst.mkdir(parents=True)
    tensors = all_tensors(src)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith(("_scale", ".input_scale")):
            continue
        plain = tensor
        if tensor.dtype == torch.float8_e4m3fn:
            scale = tensors[name.removesuffix("weight") + "weight_scale"].float()
            plain = tensor.float() * scale.reshape(-1, *([1] * (tensor.dim() - 1)))
        out[name] = plain.to(dtype).contiguous()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.suffix == ".json" and f.name not in ("hf_quant_config.json", "config.json"):
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    config["dtype"] = str(dtype).removeprefix("torch.")
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
