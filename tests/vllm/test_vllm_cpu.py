"""One test per place ``harness/vllm_cpu.py`` relies on vLLM 0.33's internals (the ops the CUDA
wheel lacks on vLLM's CPU platform, the CUTLASS pin, the model-load timer): each checks the
fact the restatement depends on in vLLM's own code, so it fails on the vLLM version where that
fact stops holding. ``test_engine_demo.py`` runs the engine they make possible."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from inspect import Parameter
from pathlib import Path
from typing import Any

import pytest
import torch

from harness import vllm_cpu
from harness.daemon_process import free_port
from tests.conftest import FIXTURES
from tests.vllm.vllm_model import build, configs, vllm_world

LLAMA = FIXTURES / "modelopt" / "llama-fp8-kv"


def _tree(module: str) -> ast.Module:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    return ast.parse(Path(spec.origin).read_text())


def _calls(module: str, callee: str) -> list[ast.Call]:
    """The calls in ``module``'s source whose callee reads ``callee`` (``ops.rotary_embedding``)."""
    return [
        node
        for node in ast.walk(_tree(module))
        if isinstance(node, ast.Call) and ast.unparse(node.func) == callee
    ]


def _imports_custom_ops_as_ops(module: str) -> bool:
    """``from vllm import _custom_ops as ops`` (at module level or in a function): a call
    ``ops.NAME`` then reads the attribute :func:`~harness.vllm_cpu.provide_cpu_ops` sets."""
    return any(
        isinstance(node, ast.ImportFrom)
        and node.module == "vllm"
        and any(a.name == "_custom_ops" and a.asname == "ops" for a in node.names)
        for node in ast.walk(_tree(module))
    )


def _vllm_signature(name: str) -> list[str]:
    """The parameters of ``vllm._custom_ops.NAME`` as vLLM defines it (read from its source:
    in a process where :func:`provide_cpu_ops` ran, the attribute is the restatement)."""
    (found,) = [
        node
        for node in _tree("vllm._custom_ops").body
        if isinstance(node, ast.FunctionDef) and node.name == name
    ]
    return [a.arg for a in found.args.args]


def _binds_as(ours: Callable[..., Any], theirs: list[str]) -> bool:
    """``ours`` takes vLLM's parameters by the same names in the same order, the ones it does
    not use through ``*args``/``**kwargs``."""
    parameters = inspect.signature(ours).parameters.values()
    named = [p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD]
    absorbs = {p.kind for p in parameters} >= {Parameter.VAR_POSITIONAL, Parameter.VAR_KEYWORD}
    return named == theirs or (theirs[: len(named)] == named and absorbs)


# Each op restated in vllm._custom_ops, by the vLLM module whose CPU path calls it.
CUSTOM_OP_CALLERS = {
    "cpu_attn_get_scheduler_metadata": "vllm.v1.attention.backends.cpu_attn",
    "cpu_attn_reshape_and_cache": "vllm.v1.attention.backends.cpu_attn",
    "cpu_attention_with_kv_cache": "vllm.v1.attention.backends.cpu_attn",
    "scaled_fp8_quant": "vllm.model_executor.layers.quantization.input_quant_fp8",
    "cutlass_scaled_mm": "vllm.model_executor.kernels.linear.scaled_mm.cutlass",
    "rotary_embedding": "vllm.model_executor.layers.rotary_embedding.base",
}
# Each op defined on torch.ops._C, by the vLLM module that calls it.
TORCH_OP_CALLERS = {
    "init_cpu_memory_env": "vllm.v1.worker.cpu_worker",
    "compute_slot_mapping_kernel_impl": "vllm.utils.cpu_triton_utils",
    "silu_and_mul_quant": "vllm.model_executor.layers.fusion.fused_act_quant",
    "greedy_argmax": "vllm.v1.sample.sampler",
}


def test_every_op_restated_has_a_caller_here() -> None:
    assert set(vllm_cpu.RESTATED) == set(CUSTOM_OP_CALLERS)
    assert set(vllm_cpu.TORCH_OPS) == set(TORCH_OP_CALLERS)


@pytest.mark.parametrize("name", sorted(CUSTOM_OP_CALLERS))
def test_vllms_cpu_path_calls_the_custom_op_by_name_with_these_parameters(name: str) -> None:
    """vLLM calls ``ops.NAME`` on ``vllm._custom_ops`` at call time (so the restatement set on
    the module is the one called), and the restatement takes vLLM's parameters."""
    caller = CUSTOM_OP_CALLERS[name]
    assert _calls(caller, f"ops.{name}"), caller
    assert _imports_custom_ops_as_ops(caller), caller
    assert _binds_as(vllm_cpu.RESTATED[name], _vllm_signature(name))


@pytest.mark.parametrize("name", sorted(TORCH_OP_CALLERS))
def test_vllm_calls_the_torch_op_as_its_schema_says(name: str) -> None:
    """vLLM calls ``torch.ops._C.NAME`` with as many arguments as the schema defined here."""
    schema = torch._C.parse_schema(vllm_cpu.TORCH_OPS[name])
    calls = _calls(TORCH_OP_CALLERS[name], f"torch.ops._C.{name}")
    assert calls, TORCH_OP_CALLERS[name]
    for call in calls:
        assert len(call.args) + len(call.keywords) == len(schema.arguments), ast.unparse(call)


def test_the_rotary_restatement_calls_forward_static_as_vllm_defines_it() -> None:
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    assert list(inspect.signature(RotaryEmbedding.forward_static).parameters) == [
        "positions",
        "query",
        "key",
        "head_size",
        "rotary_dim",
        "cos_sin_cache",
        "is_neox_style",
    ]


def test_the_kv_cache_is_split_as_the_attention_restatement_reads_it() -> None:
    """The CPU backend's KV cache is head-major inside each block (``[blocks, kv_heads,
    block_size, 2 * head_size]`` per layer), split into key and value caches with the block's
    rows on dimension 2 (where the restated ops index them) before each op is called."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.kv_cache_layout import KVCacheLayout

    assert CPUAttentionBackend.supported_kv_cache_layouts() == (KVCacheLayout.LBHNC,)
    assert KVCacheLayout.LBHNC.value == (0, 1, 2, 3, 4)  # [layer, block, head, row, content]
    splits = _calls("vllm.v1.attention.backends.cpu_attn", "kv_cache.chunk")
    assert splits and all(ast.unparse(c) == "kv_cache.chunk(2, dim=2)" for c in splits)
    views = _calls("vllm.v1.attention.backends.cpu_attn", "kv_cache.view")
    assert views and all(
        ast.unparse(c) == "kv_cache.view((num_blocks, num_kv_heads, block_size * 2, -1))"
        for c in views
    )


def test_the_pin_makes_vllm_pick_cutlass_on_the_cpu_and_is_undone() -> None:
    """vLLM's FP8 kernel choice on the CPU platform reads ``_POSSIBLE_FP8_KERNELS`` and the
    CUTLASS kernel's ``is_supported`` reads ``cutlass_fp8_supported``: inside the pin every
    ModelOpt linear layer gets the CUTLASS kernel; after it, vLLM's own lists stand."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.kernels import linear
    from vllm.model_executor.kernels.linear.scaled_mm import cutlass
    from vllm.platforms import PlatformEnum

    before = list(linear._POSSIBLE_FP8_KERNELS[PlatformEnum.CPU])
    vllm_config, model_config = configs(LLAMA)
    with (
        set_current_vllm_config(vllm_config),
        vllm_world(port=free_port()),
        vllm_cpu.cutlass_kernel_on_cpu(),
    ):
        assert cutlass.CutlassFP8ScaledMMLinearKernel.is_supported()[0]
        model = build(vllm_config, model_config, device="meta")
    kernels = {
        type(getattr(getattr(m, "quant_method", None), "kernel", None)) for m in model.modules()
    }
    assert kernels - {type(None)} == {cutlass.CutlassFP8ScaledMMLinearKernel}
    assert linear._POSSIBLE_FP8_KERNELS[PlatformEnum.CPU] == before


def test_the_timed_span_is_the_cpu_runners_model_load() -> None:
    """The CPU worker loads through ``CPUModelRunner.load_model`` (the span the timer wraps),
    which does not log "Model loading took"; the GPU runners log it around their
    ``load_model``, the span the demo prints under that name."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    assert CPUWorker.load_model is Worker.load_model
    assert _calls("vllm.v1.worker.gpu_worker", "self.model_runner.load_model")
    assert "CPUModelRunner(" in inspect.getsource(CPUWorker)
    assert "Model loading took" not in inspect.getsource(CPUModelRunner.load_model)
    for runner in ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner"):
        module: Any = importlib.import_module(runner)
        assert "Model loading took" in inspect.getsource(module.GPUModelRunner.load_model)
