"""Checkpoint variants for the state-identity tests: the same real ModelOpt export, tied or
untied, with or without KV-cache scales, with a vocabulary that needs vLLM's padding.

Fused per-tensor FP8 shards (q/k/v, gate/up) are given one weight scale, the largest of the
group, so vLLM does not requantize them: its requantization calls a CUDA-only custom op
(``_C.static_scaled_fp8_quant``) that vLLM's CPU platform cannot run, and CPU torch rounds the
dequantization scale differently from CUDA torch. Requantized layers are compared byte for byte
with vLLM's own processing on the H200 (``tests/gpu/vllm_engine_proof.py``) and with its
restatement on the CPU (``tests/modelopt_fp8/processing``).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FUSED_GROUP = re.compile(
    r"^(.*\.)(?:self_attn\.(?:q|k|v)_proj|mlp\.(?:gate|up)_proj)\.weight_scale$"
)


def _equalize_fused_scales(tensors: dict[str, torch.Tensor]) -> None:
    groups: dict[str, list[str]] = {}
    for name, t in tensors.items():
        m = FUSED_GROUP.match(name)
        if m and t.numel() == 1:
            kind = "attn" if ".self_attn." in name else "mlp"
            groups.setdefault(m.group(1) + kind, []).append(name)
    for names in groups.values():
        top = max(tensors[n].reshape(()) for n in names)
        for n in names:
            tensors[n] = top.reshape(tensors[n].shape).clone()


def _set_kv_algo(directory: Path, algo: str | None) -> None:
    hf = directory / "hf_quant_config.json"
    if hf.exists():
        data = json.loads(hf.read_text())
        data["quantization"]["kv_cache_quant_algo"] = algo
        hf.write_text(json.dumps(data))
    config = json.loads((directory / "config.json").read_text())
    qc = config.get("quantization_config")
    if isinstance(qc, dict) and qc.get("quant_method") == "modelopt":
        if algo is None:
            qc.pop("kv_cache_quant_algo", None)
            qc.pop("kv_cache_scheme", None)
        else:
            qc["kv_cache_quant_algo"] = algo
        (directory / "config.json").write_text(json.dumps(config))


def make_variant(
    src: Path,
    dst: Path,
    *,
    tied: bool = False,
    kv_scales: bool = True,
    vocab: int | None = None,
) -> Path:
    """Write ``src`` changed as asked to ``dst`` (a single safetensors file)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    _equalize_fused_scales(tensors)
    config = json.loads((dst / "config.json").read_text())
    if vocab is not None:
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name in tensors:
                tensors[name] = tensors[name][:vocab].clone()
        config["vocab_size"] = vocab
    if tied:
        tensors.pop("lm_head.weight", None)
    config["tie_word_embeddings"] = tied
    (dst / "config.json").write_text(json.dumps(config))
    if not kv_scales:
        for name in [n for n in tensors if n.endswith(("k_proj.k_scale", "v_proj.v_scale"))]:
            del tensors[name]
        _set_kv_algo(dst, None)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst
