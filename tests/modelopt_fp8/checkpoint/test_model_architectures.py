"""config.json sizes for the supported architectures and the fused layers vLLM builds."""

from __future__ import annotations

from typing import Any

import pytest

from modelopt_fp8.checkpoint.architecture import (
    Parallelism,
    kv_scale_names,
    linear_specs,
    read_dims,
)
from protocol.errors import InvalidConfigError, UnsupportedArchitectureError


def config(arch: str = "LlamaForCausalLM", **over: Any) -> dict[str, object]:
    base: dict[str, object] = {
        "architectures": [arch],
        "hidden_size": 64,
        "intermediate_size": 88,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": 128,
    }
    base.update(over)
    return base


@pytest.mark.parametrize(
    ("arch", "bias"),
    [
        ("LlamaForCausalLM", False),
        ("MistralForCausalLM", False),
        ("Qwen2ForCausalLM", True),
        ("Qwen3ForCausalLM", False),
    ],
)
def test_supported_architectures(arch: str, bias: bool) -> None:
    dims = read_dims(config(arch), "config.json")
    assert dims.head_dim == 16  # hidden / heads when head_dim is unset
    assert dims.qkv_bias is bias
    specs = linear_specs(dims)
    assert [s.prefix for s in specs[:4]] == [
        "model.layers.0.self_attn.qkv_proj",
        "model.layers.0.self_attn.o_proj",
        "model.layers.0.mlp.gate_up_proj",
        "model.layers.0.mlp.down_proj",
    ]
    qkv, o, gate_up, down = specs[:4]
    assert [s.shard_id for s in qkv.shards] == ["q", "k", "v"]
    assert [s.rows for s in qkv.shards] == [64, 32, 32]
    assert qkv.parallelism is Parallelism.QKV and qkv.has_bias is bias
    assert o.parallelism is Parallelism.ROW and o.input_size == 64
    assert [s.checkpoint_prefix.rsplit(".", 1)[1] for s in gate_up.shards] == [
        "gate_proj",
        "up_proj",
    ]
    assert down.input_size == 88 and down.output_size == 64
    assert len(specs) == 8


def test_explicit_head_dim_and_attention_bias_override() -> None:
    dims = read_dims(config("Qwen3ForCausalLM", head_dim=32, attention_bias=True), "c")
    assert dims.q_size == 128 and dims.kv_size == 64 and dims.qkv_bias


def test_unknown_architecture() -> None:
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel"):
        read_dims(config("GPT2LMHeadModel"), "config.json")


@pytest.mark.parametrize("field", ["hidden_size", "intermediate_size", "num_hidden_layers"])
def test_missing_or_bad_sizes(field: str) -> None:
    with pytest.raises(InvalidConfigError, match=field):
        read_dims(config("LlamaForCausalLM", **{field: None}), "config.json")
    with pytest.raises(InvalidConfigError, match=field):
        read_dims(config("LlamaForCausalLM", **{field: -3}), "config.json")


def test_kv_heads_must_divide_heads() -> None:
    with pytest.raises(InvalidConfigError, match="multiple of num_key_value_heads"):
        read_dims(config(num_key_value_heads=3), "config.json")


def test_kv_scale_names_follow_vllm_remapping() -> None:
    names = kv_scale_names(read_dims(config(), "c"))
    assert names["model.layers.1.self_attn.attn.v_scale"] == (
        "model.layers.1.self_attn.v_proj.v_scale",
        "model.layers.1.self_attn.v_scale",
    )
    assert len(names) == 4
