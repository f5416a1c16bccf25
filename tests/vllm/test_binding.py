"""Our names, fusions and TP slices against vLLM 0.33's own models and weight loaders."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.spawn import start_processes

from harness.daemon_process import free_port
from modelopt_fp8.checkpoint import Checkpoint
from modelopt_fp8.checkpoint.architecture import PACKED_MODULES, Parallelism, linear_specs
from modelopt_fp8.processing.plan import plan_model
from tests.conftest import FIXTURES
from tests.reference_processing import read_shards
from tests.vllm.vllm_model import build, configs, vllm_world

VLLM_CLASSES = {
    Parallelism.QKV: "QKVParallelLinear",
    Parallelism.MERGED_COLUMN: "MergedColumnParallelLinear",
    Parallelism.ROW: "RowParallelLinear",
}


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_packed_modules_and_stacking_match(arch: str) -> None:
    from vllm.model_executor.models.registry import ModelRegistry

    cls = ModelRegistry._try_load_model_cls(arch)
    assert cls is not None
    assert {k: tuple(v) for k, v in cls.packed_modules_mapping.items()} == PACKED_MODULES
    model_cls = {
        "LlamaForCausalLM": "llama",
        "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3",
    }[arch]
    module = __import__(f"vllm.model_executor.models.{model_cls}", fromlist=["x"])
    inner = {"llama": "LlamaModel", "qwen2": "Qwen2Model", "qwen3": "Qwen3Model"}[model_cls]
    stacked = getattr(module, inner).hf_to_vllm_mapper.orig_to_new_stacked
    ours = {
        f".{s.checkpoint_prefix.rsplit('.', 1)[1]}": (
            f".{spec.prefix.rsplit('.', 1)[1]}",
            s.shard_id,
        )
        for spec in linear_specs(Checkpoint.open(FIXTURES / "modelopt" / "qwen2-fp8").dims)
        for s in spec.shards
        if len(spec.shards) > 1
    }
    assert {k: (v[0], str(v[1])) for k, v in stacked.items()} == ours


@pytest.mark.parametrize("export", ["llama-fp8-kv", "qwen2-fp8", "qwen3-fp8-pc-pt"])
def test_every_layer_we_serve_is_a_vllm_module(export: str) -> None:
    path = FIXTURES / "modelopt" / export
    vllm_config, model_config = configs(path)
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config), vllm_world(port=free_port()):
        model = build(vllm_config, model_config, device="meta")
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    with Checkpoint.open(path) as ckpt:
        plan = plan_model(ckpt)
        specs = linear_specs(ckpt.dims)
    for spec in specs:
        assert type(modules[spec.prefix]).__name__ == VLLM_CLASSES[spec.parallelism]
        assert f"{spec.prefix}.weight" in params
    for carried in plan.carried:
        assert carried.spec.name in params, carried.spec.name


def _present(t: torch.Tensor | None) -> torch.Tensor:
    assert t is not None
    return t


def _rank_worker(rank: int, tp: int, path: str, port: int, out: str) -> None:
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    vllm_config, model_config = configs(Path(path), tp_size=tp)
    result: dict[str, list] = {"mismatch": [], "checked": []}
    with set_current_vllm_config(vllm_config), vllm_world(tp, rank, port):
        model = build(vllm_config, model_config)
        get_model_loader(vllm_config.load_config).load_weights(model, model_config)
        modules = dict(model.named_modules())
        with Checkpoint.open(Path(path)) as ckpt:
            plan = plan_model(ckpt, tp, rank)
            for lp in plan.linears:
                module = modules[lp.layout.name]
                ours = torch.cat(read_shards(ckpt, lp))
                theirs = module.weight.data  # vLLM's fused, sharded weight before processing
                same = theirs.shape == ours.shape and torch.equal(
                    theirs.view(torch.uint8), ours.contiguous().view(torch.uint8)
                )
                scale = module.weight_scale.data
                scales = lp.shard_scales(plan.scales)
                if lp.layout.scheme == "fp8":
                    ours_scale = torch.stack([_present(s.weight_scale).reshape(()) for s in scales])
                    same = same and torch.equal(scale, ours_scale)
                    ours_in = torch.stack([_present(s.input_scale).reshape(()) for s in scales])
                    same = same and torch.equal(module.input_scale.data, ours_in)
                else:  # per channel: this rank's rows of each shard's scales
                    rows = [_present(s.weight_scale).reshape(-1)[slice(*s.rows)] for s in scales]
                    same = same and torch.equal(scale, torch.cat(rows))
                result["checked" if same else "mismatch"].append(lp.layout.name)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.parametrize(("export", "tp"), [("llama-fp8-kv", 4), ("qwen3-fp8-pc-pt", 2)])
def test_tp_slices_equal_vllms_own_loaders(export: str, tp: int, tmp_path: Path) -> None:
    """Each rank, in its own process on gloo, loads the checkpoint with vLLM's default loader;
    the fused, sharded weights and scales vLLM holds before processing equal ours byte for
    byte (TP 4 with 2 kv heads exercises kv-head replication)."""
    path = FIXTURES / "modelopt" / export
    start_processes(
        _rank_worker,
        args=(tp, str(path), free_port(), str(tmp_path)),
        nprocs=tp,
        join=True,
        start_method="spawn",
    )
    for rank in range(tp):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["mismatch"] == [], (rank, result)
        assert len(result["checked"]) == 8
