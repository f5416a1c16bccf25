"""Deterministic demo checkpoints, made without a network: in ModelOpt's FP8 export formats
(which the daemon processes), and in block FP8 and bf16 (which engines donate).

Random bf16-like weights in a real architecture's shapes are quantized the way each format's
exporter does it (``service/demo_formats/``: ModelOpt per tensor, ``scale = amax / 448``, or per
channel; block FP8 per 128x128 block; bf16 not at all), and written with the same files, tensor
names, dtypes and configs such an export has. ``tiny`` is for tests: two layers, q/k/v with
unequal scales, KV-cache scales, and a gate/up width that CUTLASS must pad; ``tiny-128`` is as
small with widths block FP8's blocks divide. The larger shapes are for benchmarks.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from modelopt_fp8.checkpoint.architecture import LinearSpec, ModelDims, linear_specs
from service.demo_formats import FORMATS, DemoFormat

SCHEMES = FORMATS  # by demo name: fp8, fp8-pc-pt (ModelOpt's), fp8-block, bf16
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class DemoShape:
    dims: ModelDims
    model_type: str
    kv_cache: bool


def _dims(
    arch: str,
    h: int,
    inter: int,
    heads: int,
    kv: int,
    hd: int,
    layers: int,
    vocab: int,
    tied: bool,
    bias: bool,
) -> ModelDims:
    return ModelDims(arch, h, inter, heads, kv, hd, layers, vocab, bias, False, tied)


SHAPES: dict[str, DemoShape] = {
    # 84 intermediate: gate_up N = 168 and down K = 84 both need CUTLASS padding; TP 2 and 4 work.
    "tiny": DemoShape(
        _dims("LlamaForCausalLM", 64, 84, 4, 2, 16, 2, 256, False, False), "llama", True
    ),
    # Every fused shard's rows a multiple of 128: what vLLM needs of block FP8's 128x128 blocks.
    "tiny-128": DemoShape(
        _dims("LlamaForCausalLM", 256, 384, 2, 1, 128, 2, 256, False, False), "llama", False
    ),
    "qwen2.5-0.5b": DemoShape(
        _dims("Qwen2ForCausalLM", 896, 4864, 14, 2, 64, 24, 151936, True, True), "qwen2", False
    ),
    "llama-8b": DemoShape(
        _dims("LlamaForCausalLM", 4096, 14336, 32, 8, 128, 32, 128256, False, False),
        "llama",
        False,
    ),
}


def _config(shape: DemoShape, demo_format: DemoFormat) -> dict[str, object]:
    d = shape.dims
    config: dict[str, object] = {
        "architectures": [d.architecture],
        "model_type": shape.model_type,
        "attention_bias": d.qkv_bias,
        "mlp_bias": d.mlp_bias,
        "dtype": "bfloat16",
        "head_dim": d.head_dim,
        "hidden_act": "silu",
        "hidden_size": d.hidden_size,
        "intermediate_size": d.intermediate_size,
        "max_position_embeddings": 4096,
        "num_attention_heads": d.num_attention_heads,
        "num_hidden_layers": d.num_hidden_layers,
        "num_key_value_heads": d.num_key_value_heads,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": d.tie_word_embeddings,
        "vocab_size": d.vocab_size,
    }
    quantization_config = demo_format.quantization_config(_kv_cache(shape, demo_format))
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    return config


def _kv_cache(shape: DemoShape, demo_format: DemoFormat) -> bool:
    """Whether KV-cache scales are written: the shape has them and the format writes them."""
    return shape.kv_cache and demo_format.kv_cache_scales


class _Generator:
    """Draws every tensor from one seeded generator, in a fixed order."""

    CHUNK_ROWS = 4096

    def __init__(self, seed: int, device: str = "cpu") -> None:
        self.device = torch.device(device)
        self.gen = torch.Generator(self.device).manual_seed(seed)

    def normal(self, rows: int, cols: int, std: float) -> torch.Tensor:
        return torch.randn(rows, cols, generator=self.gen, device=self.device) * std

    def bf16(self, shape: tuple[int, ...], std: float) -> torch.Tensor:
        out = torch.empty(shape, dtype=torch.bfloat16)
        flat = out.view(shape[0], -1) if len(shape) > 1 else out.view(1, -1)
        for start in range(0, flat.shape[0], self.CHUNK_ROWS):
            block = flat[start : start + self.CHUNK_ROWS]
            block.copy_(self.normal(block.shape[0], block.shape[1], std).cpu())
        return out

    def uniform(self, low: float, high: float) -> float:
        return low + (high - low) * float(torch.rand((), generator=self.gen, device=self.device))

    def weight(self, rows: int, cols: int) -> torch.Tensor:
        """A float weight of a random spread, as a scheme quantizes it."""
        return self.normal(rows, cols, std=0.02 * self.uniform(0.5, 2.0))


def _linear_tensors(
    spec: LinearSpec, demo_format: DemoFormat, kv_cache: bool, gen: _Generator
) -> Iterator[tuple[str, torch.Tensor]]:
    # ModelOpt gives the projections that share an input (the shards of one fused layer) the
    # same input scale, and each its own weight scale.
    input_scale = gen.uniform(0.005, 0.05)
    for shard in spec.shards:
        weight = gen.weight(shard.rows, spec.input_size)
        yield from demo_format.export(shard.checkpoint_prefix, weight, input_scale)
        if spec.has_bias:
            yield f"{shard.checkpoint_prefix}.bias", gen.bf16((shard.rows,), 0.02)
        if kv_cache and shard.shard_id in ("k", "v"):
            yield (
                f"{shard.checkpoint_prefix}.{shard.shard_id}_scale",
                torch.tensor(gen.uniform(0.001, 0.01), dtype=torch.float32),
            )


def _tensors(
    shape: DemoShape, demo_format: DemoFormat, gen: _Generator
) -> Iterator[tuple[str, torch.Tensor]]:
    d = shape.dims
    norm_names = {
        "qkv_proj": "input_layernorm",
        "gate_up_proj": "post_attention_layernorm",
    }
    yield "model.embed_tokens.weight", gen.bf16((d.vocab_size, d.hidden_size), 0.02)
    for spec in linear_specs(d):
        layer_prefix, _, kind = spec.prefix.rpartition(".")
        if kind in norm_names:
            block = layer_prefix.rsplit(".", 1)[0]
            yield f"{block}.{norm_names[kind]}.weight", gen.bf16((d.hidden_size,), 0.1) + 1.0
        yield from _linear_tensors(spec, demo_format, _kv_cache(shape, demo_format), gen)
    yield "model.norm.weight", gen.bf16((d.hidden_size,), 0.1) + 1.0
    if not d.tie_word_embeddings:
        yield "lm_head.weight", gen.bf16((d.vocab_size, d.hidden_size), 0.02)


def expected_bytes(shape: DemoShape) -> int:
    """Roughly how many bytes of tensors a shape produces (for progress)."""
    d = shape.dims
    linear = sum(s.output_size * s.input_size for s in linear_specs(d))
    embeds = d.vocab_size * d.hidden_size * 2 * (1 if d.tie_word_embeddings else 2)
    return linear + embeds


def _file_mode() -> int:
    """The mode an ordinary new file gets here: 0666 less the process's umask."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass
    return 0o644


def write_demo_checkpoint(
    out: Path,
    scheme: str = "fp8",
    shape: str = "tiny",
    seed: int = 0,
    shard_bytes: int = 4 << 30,
    progress: Callable[[int], None] | None = None,
    device: str = "cpu",
) -> Path:
    """Write the checkpoint into ``out`` (created) and return it.

    Files larger than ``shard_bytes`` are split into ``model-0000k-of-0000n.safetensors`` with an
    index, as ``save_pretrained`` does.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {sorted(SCHEMES)}")
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}")
    demo_format, demo = SCHEMES[scheme], SHAPES[shape]
    for spec in linear_specs(demo.dims):
        demo_format.check_layer(spec)
    out.mkdir(parents=True, exist_ok=True)
    gen = _Generator(seed, device)
    current: dict[str, torch.Tensor] = {}
    files: list[list[str]] = []
    size = total_size = 0

    def flush() -> None:
        save_file(current, str(out / f"part-{len(files):05d}.tmp"), metadata={"format": "pt"})
        files.append(list(current))
        current.clear()

    for name, tensor in _tensors(demo, demo_format, gen):
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > shard_bytes:
            flush()
            size = 0
        current[name] = tensor.contiguous()
        size += nbytes
        total_size += nbytes
        if progress:
            progress(nbytes)
    flush()

    weight_map: dict[str, str] = {}
    mode = _file_mode()  # safetensors writes 0600; a checkpoint is for others to read
    for i, names in enumerate(files):
        final = (
            "model.safetensors"
            if len(files) == 1
            else f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        )
        weight_map.update(dict.fromkeys(names, final))
        part = out / f"part-{i:05d}.tmp"
        part.chmod(mode)
        part.replace(out / final)
    if len(files) > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(_config(demo, demo_format), indent=4))
    hf_quant_config = demo_format.hf_quant_config(_kv_cache(demo, demo_format))
    if hf_quant_config is not None:
        (out / "hf_quant_config.json").write_text(json.dumps(hf_quant_config, indent=4))
    return out
