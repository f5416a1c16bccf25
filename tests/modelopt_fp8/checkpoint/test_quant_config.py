"""Both ModelOpt config forms, the supported algorithms, and vLLM's exclusion matching."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modelopt_fp8.checkpoint.architecture import PACKED_MODULES
from modelopt_fp8.checkpoint.quant_config import QuantConfig, read_quant_config
from protocol.errors import (
    InvalidConfigError,
    NotModelOptCheckpointError,
    UnsupportedQuantAlgoError,
)

PACKED = dict(PACKED_MODULES)


def write(tmp_path: Path, hf: dict | None = None, qc: dict | None = None) -> tuple[Path, dict]:
    if hf is not None:
        (tmp_path / "hf_quant_config.json").write_text(json.dumps(hf))
    config: dict = {"architectures": ["LlamaForCausalLM"]}
    if qc is not None:
        config["quantization_config"] = qc
    return tmp_path, config


def hf_form(algo: str = "FP8", kv: str | None = "FP8", exclude: list[str] | None = None) -> dict:
    return {
        "producer": {"name": "modelopt", "version": "0.47.0"},
        "quantization": {
            "quant_algo": algo,
            "kv_cache_quant_algo": kv,
            "exclude_modules": exclude if exclude is not None else ["lm_head"],
        },
    }


def test_hf_quant_config_form(tmp_path: Path) -> None:
    qc = read_quant_config(*write(tmp_path, hf=hf_form()))
    assert qc.quant_algo == "FP8"
    assert qc.kv_cache_quant_algo == "FP8"
    assert qc.exclude_modules == ("lm_head",)
    assert qc.producer["name"] == "modelopt"


def test_config_json_form_with_kv_cache_scheme(tmp_path: Path) -> None:
    qc = read_quant_config(
        *write(
            tmp_path,
            qc={
                "quant_method": "modelopt",
                "quant_algo": "fp8_per_channel_per_token",
                "ignore": ["lm_head", "model.embed_tokens"],
                "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"},
            },
        )
    )
    assert qc.quant_algo == "FP8_PER_CHANNEL_PER_TOKEN"  # case-normalised as vLLM does
    assert qc.kv_cache_quant_algo == "FP8"
    assert qc.exclude_modules == ("lm_head", "model.embed_tokens")


def test_both_forms_must_agree(tmp_path: Path) -> None:
    with pytest.raises(InvalidConfigError, match=r"config\.json says FP8_PER_CHANNEL"):
        read_quant_config(
            *write(
                tmp_path,
                hf=hf_form("FP8"),
                qc={"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"},
            )
        )


@pytest.mark.parametrize("algo", ["FP8_PB_WO", "NVFP4", "MXFP8", "W4A8_AWQ", "FP9_MADE_UP"])
def test_unsupported_algorithms_are_refused_with_the_supported_list(
    tmp_path: Path, algo: str
) -> None:
    with pytest.raises(UnsupportedQuantAlgoError) as err:
        read_quant_config(*write(tmp_path, hf=hf_form(algo)))
    assert "FP8, FP8_PER_CHANNEL_PER_TOKEN" in err.value.detail
    assert err.value.extra["quant_algo"] == algo
    assert err.value.extra["file"].endswith("hf_quant_config.json")


def test_non_modelopt_checkpoints_are_refused(tmp_path: Path) -> None:
    with pytest.raises(NotModelOptCheckpointError):
        read_quant_config(*write(tmp_path))
    with pytest.raises(NotModelOptCheckpointError, match="compressed-tensors"):
        read_quant_config(*write(tmp_path, qc={"quant_method": "compressed-tensors"}))


def test_missing_algorithm_and_bad_exclude_list(tmp_path: Path) -> None:
    with pytest.raises(InvalidConfigError, match="quant_algo"):
        read_quant_config(*write(tmp_path, qc={"quant_method": "modelopt"}))
    with pytest.raises(InvalidConfigError, match="exclude_modules"):
        read_quant_config(
            *write(
                tmp_path, qc={"quant_method": "modelopt", "quant_algo": "FP8", "ignore": "lm_head"}
            )
        )


def test_unparseable_hf_quant_config(tmp_path: Path) -> None:
    (tmp_path / "hf_quant_config.json").write_text("{nope")
    with pytest.raises(InvalidConfigError, match="cannot parse"):
        read_quant_config(tmp_path, {})


def cfg(*exclude: str) -> QuantConfig:
    return QuantConfig("FP8", None, tuple(exclude), "test")


@pytest.mark.parametrize(
    ("exclude", "prefix", "excluded"),
    [
        (("lm_head",), "lm_head", True),
        (("lm_head",), "model.layers.0.self_attn.qkv_proj", False),
        # the fused name itself, or all of its shards
        (("model.layers.0.self_attn.qkv_proj",), "model.layers.0.self_attn.qkv_proj", True),
        (
            ("model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"),
            "model.layers.1.mlp.gate_up_proj",
            True,
        ),
        # substring matching (ModelOpt < 0.39 exports)
        (("model.layers.0.mlp",), "model.layers.0.mlp.down_proj", True),
        (("self_attn",), "model.layers.3.self_attn.o_proj", True),
        # wildcards
        (("*.mlp.down_proj",), "model.layers.7.mlp.down_proj", True),
        (("model.layers.1*",), "model.layers.10.mlp.down_proj", True),
        (("*.mlp.down_proj",), "model.layers.7.mlp.gate_up_proj", False),
    ],
)
def test_exclusion_matches_vllm(exclude: tuple[str, ...], prefix: str, excluded: bool) -> None:
    assert cfg(*exclude).is_excluded(prefix, PACKED) is excluded


def test_partially_excluded_fused_layer_is_refused() -> None:
    with pytest.raises(InvalidConfigError, match="some but not all shards"):
        cfg("model.layers.0.self_attn.q_proj").is_excluded(
            "model.layers.0.self_attn.qkv_proj", PACKED
        )
