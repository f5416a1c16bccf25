"""One test per place ``engine_client/vllm/internals.py`` relies on vLLM 0.33's internals: each
builds what vLLM builds and checks the fact the loader depends on, so it fails on the vLLM
version where that fact stops holding."""

from __future__ import annotations

import ast
import contextlib
import gc
import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from harness.daemon_process import free_port
from harness.python_child import run_python
from modelopt_fp8.checkpoint import Checkpoint
from modelopt_fp8.processing.plan import plan_model
from protocol.schemas.layout import CarriedKind
from tests.conftest import FIXTURES
from tests.vllm.cpu_capabilities import FP8_KV_CACHE_NEEDS, current_view, viewing
from tests.vllm.model_state import model_state
from tests.vllm.variants import make_variant
from tests.vllm.vllm_model import build, configs, cutlass_kernel_on_cpu, vllm_world

LLAMA = FIXTURES / "modelopt" / "llama-fp8-kv"  # per-tensor FP8, KV-cache scales, K=88 padded
ROW_LAYERS = ("model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj")


@contextlib.contextmanager
def vllm_for(path: Path, **kw: Any) -> Iterator[tuple[Any, Any]]:
    """vLLM's config and a one-rank world for ``path``, with the CUTLASS kernel pinned."""
    from vllm.config import set_current_vllm_config

    vllm_config, model_config = configs(path, **kw)
    with (
        set_current_vllm_config(vllm_config),
        vllm_world(port=free_port()),
        cutlass_kernel_on_cpu(),
    ):
        yield vllm_config, model_config


def fresh_build(vllm_config: Any, model_config: Any, device: str) -> nn.Module:
    """A build as in a fresh engine process: vLLM's rotary cache and forward context empty."""
    from vllm.model_executor.layers import rotary_embedding

    rotary_embedding._ROPE_DICT.clear()
    vllm_config.compilation_config.static_forward_context.clear()
    return build(vllm_config, model_config, device=device)


def loaded(vllm_config: Any, model_config: Any) -> nn.Module:
    """A CPU build with the checkpoint loaded by vLLM's default loader, not yet processed."""
    from vllm.model_executor.model_loader import get_model_loader

    model = fresh_build(vllm_config, model_config, "cpu")
    get_model_loader(vllm_config.load_config).load_weights(model, model_config)
    return model


def test_forget_build_on_error_undoes_what_a_build_registers() -> None:
    """A build enters its attention layers in the config's forward context and caches its
    rotary embeddings in ``_ROPE_DICT``; after a failure both are as before, so the next build
    (the fallback's) registers the same layer names again and gets real rotary caches."""
    from vllm.model_executor.layers import rotary_embedding

    from engine_client.vllm.internals import forget_build_on_error

    with vllm_for(LLAMA) as (vllm_config, model_config):
        context = vllm_config.compilation_config.static_forward_context
        rotary_embedding._ROPE_DICT.clear()
        context.clear()
        seen: dict[str, set] = {}
        with (
            pytest.raises(RuntimeError, match="after the build"),
            forget_build_on_error(vllm_config),
        ):
            build(vllm_config, model_config, device="meta")
            seen["layers"], seen["ropes"] = set(context), set(rotary_embedding._ROPE_DICT)
            raise RuntimeError("after the build")
        assert seen["layers"] and seen["ropes"], "the build registered nothing to undo"
        assert set(context) == set() and rotary_embedding._ROPE_DICT == {}
        build(vllm_config, model_config, device="cpu")
        assert set(context) == seen["layers"]
        caches = [r.cos_sin_cache for r in rotary_embedding._ROPE_DICT.values()]
        assert caches and all(c.device.type == "cpu" for c in caches)


def test_parameter_like_keeps_vllms_class_and_loaders() -> None:
    """A parameter rebuilt on new data keeps vLLM's class and loader state, and vLLM's own
    weight loaders still load into it (row-parallel and a fused q/k/v shard)."""
    from vllm.model_executor.parameter import BasevLLMParameter

    from engine_client.vllm.internals import parameter_like

    with vllm_for(LLAMA) as (vllm_config, model_config):
        model = fresh_build(vllm_config, model_config, "meta")
    vllm_params = 0
    for name, param in model.named_parameters():
        old: Any = param
        new: Any = parameter_like(old, torch.zeros(old.shape, dtype=old.dtype))
        assert type(new) is type(old), name
        assert not new.requires_grad and new.device.type == "cpu"
        assert vars(new) == vars(old), name
        if isinstance(old, BasevLLMParameter):
            vllm_params += 1
            assert new.weight_loader is old.weight_loader
            assert (new.tp_rank, new.tp_size) == (old.tp_rank, old.tp_size)
    assert vllm_params

    modules = dict(model.named_modules())
    with Checkpoint.open(LLAMA) as ckpt:
        o_proj = ckpt.read("model.layers.0.self_attn.o_proj.weight")
        q_proj = ckpt.read("model.layers.0.self_attn.q_proj.weight")
    o = modules["model.layers.0.self_attn.o_proj"].weight
    o_new: Any = parameter_like(o, torch.zeros(o.shape, dtype=o.dtype))
    o_new.weight_loader(o_new, o_proj)
    assert torch.equal(o_new.view(torch.uint8), o_proj.view(torch.uint8))
    qkv = modules["model.layers.0.self_attn.qkv_proj"].weight
    qkv_new: Any = parameter_like(qkv, torch.zeros(qkv.shape, dtype=qkv.dtype))
    qkv_new.weight_loader(qkv_new, q_proj, "q")
    rows = q_proj.shape[0]
    assert torch.equal(qkv_new[:rows].view(torch.uint8), q_proj.view(torch.uint8))
    assert not qkv_new[rows:].view(torch.uint8).any()


def test_engine_kernel_names_vllms_cutlass_kernel() -> None:
    """With CUTLASS selected (as on Hopper) every ModelOpt linear layer reports ``cutlass``;
    with vLLM's own choice on this CPU it reports that kernel's class, and modules without a
    kernel report none."""
    from vllm.config import set_current_vllm_config

    from engine_client.vllm.internals import engine_kernel

    with vllm_for(LLAMA) as (vllm_config, model_config):
        model = fresh_build(vllm_config, model_config, "meta")
    kernels = {name: engine_kernel(m) for name, m in model.named_modules()}
    assert kernels["model.layers.0.self_attn.qkv_proj"] == "cutlass"
    assert {k for k in kernels.values() if k is not None} == {"cutlass"}
    assert kernels["model.norm"] is None and kernels["model.embed_tokens"] is None

    vllm_config, model_config = configs(LLAMA)
    with set_current_vllm_config(vllm_config), vllm_world(port=free_port()):
        own_choice = fresh_build(vllm_config, model_config, "meta")
    chosen = {engine_kernel(m) for m in own_choice.modules()} - {None}
    assert chosen and "cutlass" not in chosen


def test_linear_shape_is_the_layer_vllm_built() -> None:
    from engine_client.vllm.internals import linear_shape

    with vllm_for(LLAMA) as (vllm_config, model_config):
        model = fresh_build(vllm_config, model_config, "meta")
    modules = dict(model.named_modules())
    with Checkpoint.open(LLAMA) as ckpt:
        layouts = {layout.name: layout for layout in plan_model(ckpt).layouts}
    for name, layout in layouts.items():
        assert linear_shape(modules[name]) == (layout.logical_widths, layout.input_size), name
    assert linear_shape(modules["model.norm"]) is None


def test_processed_state_is_what_vllms_post_processing_sets() -> None:
    """On layers vLLM post-processes itself (one unpadded, one whose K=88 is padded), the plain
    attributes of the layer, its quant method, its kernel and its parameters (the weight's
    loader included) equal what ``set_processed_state`` sets from the plan."""
    from engine_client.vllm.internals import set_processed_state

    with Checkpoint.open(LLAMA) as ckpt:
        layouts = {layout.name: layout for layout in plan_model(ckpt).layouts}
    assert any(layouts[n].padded_input_size != layouts[n].input_size for n in ROW_LAYERS)
    with vllm_for(LLAMA) as (vllm_config, model_config):
        theirs = dict(loaded(vllm_config, model_config).named_modules())
        ours = dict(loaded(vllm_config, model_config).named_modules())
    for name in ROW_LAYERS:
        before = model_state(ours[name]).attributes
        theirs[name].quant_method.process_weights_after_loading(theirs[name])
        set_processed_state(ours[name], layouts[name])
        after = model_state(ours[name]).attributes
        assert before != after, f"{name}: nothing to set"
        assert after == model_state(theirs[name]).attributes, name


def test_skip_post_processing_leaves_the_layers_to_the_lease() -> None:
    """``process_weights_after_loading`` processes ModelOpt layers (transposes the weight), and
    leaves the ones given to ``skip_post_processing`` as they are, their methods restored."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from engine_client.vllm.internals import skip_post_processing

    with vllm_for(LLAMA) as (vllm_config, model_config):
        modules = dict(loaded(vllm_config, model_config).named_modules())
    skipped, processed = (modules[n] for n in ROW_LAYERS)
    methods = [skipped.quant_method, processed.quant_method]
    weights = [skipped.weight, processed.weight]
    out_features = processed.weight.shape[0]  # [N, K] as loaded
    skipped_data = skipped.weight.detach().clone()
    assert all(hasattr(m, "update_param_tp_status") for m in (skipped, processed))
    layers = nn.ModuleDict({"skipped": skipped, "processed": processed})
    with skip_post_processing([skipped]):
        process_weights_after_loading(layers, model_config, torch.device("cpu"))
    assert [skipped.quant_method, processed.quant_method] == methods
    assert skipped.weight is weights[0] and torch.equal(
        skipped.weight.view(torch.uint8), skipped_data.view(torch.uint8)
    )
    assert processed.weight.shape[1] == out_features and processed.weight.stride(0) == 1  # [K, N]


def test_vocab_shard_is_how_vllm_pads_the_vocabulary(tmp_path: Path) -> None:
    from engine_client.vllm.internals import vocab_shard

    path = make_variant(LLAMA, tmp_path / "vocab100", vocab=100)
    with vllm_for(path) as (vllm_config, model_config):
        model = fresh_build(vllm_config, model_config, "meta")
    modules = dict(model.named_modules())
    with Checkpoint.open(path) as ckpt:
        carried = plan_model(ckpt).carried_layouts
    vocab = [c for c in carried if c.kind is CarriedKind.vocab_parallel]
    assert vocab
    for layout in vocab:
        module = modules[layout.name.rpartition(".")[0]]
        shard = vocab_shard(module)
        assert shard is not None
        assert (shard.vocab_size, shard.start, shard.end, shard.padding_size) == (
            layout.vocab_size,
            layout.vocab_start,
            layout.vocab_end,
            layout.padding_size,
        )
        assert shard.padding_size > 1 and shard.added_embeddings == 0
        rows = module.weight.shape[0]  # this rank's rows, padded to a multiple of padding_size
        assert rows > shard.end - shard.start and rows % shard.padding_size == 0
    assert vocab_shard(modules["model.norm"]) is None


def rebuilt_like_cpu(
    needs: Callable[[nn.Module], bool], rebuild: Callable[[Any], None], **kw: Any
) -> list[nn.Module]:
    """Build the model on meta and on the CPU; rebuild on the CPU, in the model's dtype (as the
    loader does on its target device), every meta module ``needs`` names, and check each then
    equals the CPU build's module. Returns the rebuilt modules."""
    from vllm.utils.torch_utils import set_default_torch_dtype

    with vllm_for(LLAMA, **kw) as (vllm_config, model_config):
        meta = fresh_build(vllm_config, model_config, "meta")
        cpu_modules = dict(fresh_build(vllm_config, model_config, "cpu").named_modules())
    rebuilt = []
    for name, module in meta.named_modules():
        if not needs(module):
            continue
        with set_default_torch_dtype(torch.bfloat16), torch.device("cpu"):
            rebuild(module)
        assert not needs(module), name
        assert model_state(module).differences(model_state(cpu_modules[name])) == []
        rebuilt.append(module)
    assert rebuilt, "nothing to rebuild"
    return rebuilt


def test_rotary_cache_is_rebuilt_as_vllm_builds_it() -> None:
    from engine_client.vllm.internals import has_meta_rotary_cache, rebuild_rotary_cache

    rebuilt_like_cpu(has_meta_rotary_cache, rebuild_rotary_cache)


@pytest.mark.parametrize(
    ("kv_cache_dtype", "stand_in"),
    [
        pytest.param("auto", False, id="auto"),
        # vLLM's CPU attention takes an FP8 KV cache only with AVX-512; what the layer holds
        # after its build does not depend on it: stand in for it, and ask the host where it can
        pytest.param("fp8", True, id="fp8-standin"),
        pytest.param(
            "fp8", False, id="fp8-host", marks=pytest.mark.host_capability(FP8_KV_CACHE_NEEDS)
        ),
    ],
)
def test_attention_state_is_rebuilt_as_vllm_builds_it(kv_cache_dtype: str, stand_in: bool) -> None:
    """Scale buffers, host copies, the ``kv_cache`` placeholder and (with KV-cache scales in
    the checkpoint) the KV-cache scale parameters, as ``Attention.__init__`` leaves them."""
    from engine_client.vllm.internals import (
        KV_SCALE_PARAMETERS,
        has_meta_attention_scales,
        rebuild_attention_state,
    )

    view = current_view().claiming(FP8_KV_CACHE_NEEDS) if stand_in else current_view()
    with viewing(view):
        rebuilt = rebuilt_like_cpu(
            has_meta_attention_scales, rebuild_attention_state, kv_cache_dtype=kv_cache_dtype
        )
    for module in rebuilt:
        assert set(KV_SCALE_PARAMETERS) <= set(dict(module.named_parameters()))


def test_kv_cache_method_creates_the_scale_parameters_named() -> None:
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

    from engine_client.vllm.internals import KV_SCALE_PARAMETERS

    layer = nn.Module()
    BaseKVCacheMethod.create_weights(None, layer)  # it reads nothing of its quant config
    assert set(dict(layer.named_parameters())) == set(KV_SCALE_PARAMETERS)


def _function(module: str, cls: str, name: str) -> ast.FunctionDef:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    (found,) = [
        f
        for c in tree.body
        if isinstance(c, ast.ClassDef) and c.name == cls
        for f in c.body
        if isinstance(f, ast.FunctionDef) and f.name == name
    ]
    return found


def _calls(node: ast.AST) -> set[str]:
    return {
        n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
        for n in ast.walk(node)
        if isinstance(n, ast.Call)
    }


def test_the_worker_asks_before_its_load_window() -> None:
    """The loader freezes the startup heap in the worker's last call before the load window:
    ``init_device`` calls ``get_external_weight_memory``, and both model runners load the model
    inside ``DeviceMemoryProfiler``."""
    assert "get_external_weight_memory" in _calls(
        _function("vllm.v1.worker.gpu_worker", "Worker", "init_device")
    )
    assert "get_external_weight_memory" not in _calls(
        _function("vllm.v1.worker.gpu_worker", "Worker", "load_model")
    )
    for runner in ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner"):
        load = _function(runner, "GPUModelRunner", "load_model")
        windows = [
            w
            for w in ast.walk(load)
            if isinstance(w, ast.With) and "DeviceMemoryProfiler" in _calls(w)
        ]
        assert windows and "load_model" in _calls(windows[0]), runner


def test_the_load_window_collects_and_the_freeze_spares_the_heap() -> None:
    """vLLM's ``DeviceMemoryProfiler`` runs full collections around the load (what the freeze
    is for), and ``freeze_startup_heap`` moves every live object out of their reach."""
    from vllm.utils.mem_utils import DeviceMemoryProfiler

    from engine_client.vllm.internals import freeze_startup_heap

    full: list[str] = []

    def record(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            full.append(phase)

    gc.callbacks.append(record)
    try:
        with DeviceMemoryProfiler(torch.device("cpu")):
            entering = len(full)
        assert entering >= 1 and len(full) > entering
    finally:
        gc.callbacks.remove(record)
    alive = type("Alive", (), {})()
    assert any(o is alive for o in gc.get_objects())
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > 0
        assert not any(o is alive for o in gc.get_objects())
    finally:
        gc.unfreeze()


def _calls_in(function: Callable[..., Any]) -> set[str]:
    """The dotted names ``function`` calls (``torch.accelerator.get_memory_info``, ...)."""
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}


def test_vllm_sizes_the_kv_cache_from_the_memory_reading_the_view_replaces() -> None:
    from vllm.utils.mem_utils import MemorySnapshot, memory_profiling
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    reading = "torch.accelerator.get_memory_info"
    assert reading in _calls_in(MemorySnapshot.measure)
    assert reading in _calls_in(GPUModelRunner.profile_cudagraph_memory)
    source = inspect_source(memory_profiling)
    # what the engine takes for its own consumption: the fall of free memory since the init
    # snapshot, whoever made it
    assert "result.before_create.free_memory - result.after_profile.free_memory" in source


def inspect_source(function: Callable[..., Any]) -> str:
    import inspect

    return inspect.getsource(function)


def test_the_view_sees_this_process_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process's allocation or release (the GPU's free memory moving) changes nothing;
    this process's own growth does, byte for byte; the reading is vLLM's again after."""
    from engine_client.vllm.internals import see_only_own_memory

    gib = 1 << 30
    gpu = {"free": 60 * gib, "own": 2 * gib}

    def reading(device: Any = None) -> tuple[int, int]:
        return gpu["free"], 80 * gib

    monkeypatch.setattr(torch.accelerator, "get_memory_info", reading)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    restore = see_only_own_memory(lambda: gpu["own"], 0)
    gpu["free"] -= 5 * gib  # another engine's context and KV cache
    assert torch.accelerator.get_memory_info(0) == (60 * gib, 80 * gib)
    gpu["free"] -= 3 * gib  # this engine's own profile run...
    gpu["own"] += 3 * gib
    assert torch.accelerator.get_memory_info("cuda:0") == (57 * gib, 80 * gib)
    gpu["free"] += 20 * gib  # ...while a killed engine's memory is freed
    assert torch.accelerator.get_memory_info() == (57 * gib, 80 * gib)
    assert torch.accelerator.get_memory_info(1) == (gpu["free"], 80 * gib)  # another device
    restore()
    assert torch.accelerator.get_memory_info(0) == (gpu["free"], 80 * gib)


def test_without_a_reading_of_its_own_the_view_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine_client.vllm.internals import see_only_own_memory

    def reading(device: Any = None) -> tuple[int, int]:
        return 1, 2

    monkeypatch.setattr(torch.accelerator, "get_memory_info", reading)
    see_only_own_memory(lambda: None, 0)()
    assert torch.accelerator.get_memory_info is reading


# --- donated models -------------------------------------------------------------------------------


def test_picked_kernels_names_each_method_and_kernel_vllm_picked() -> None:
    """vLLM keeps the linear kernel it selected as the quant method's ``kernel``: with CUTLASS
    pinned every ModelOpt layer names it, and unquantized modules name their method alone."""
    from engine_client.vllm.internals import picked_kernels, vllm_version

    with vllm_for(LLAMA) as (vllm_config, model_config):
        model = fresh_build(vllm_config, model_config, "meta")
    picked = picked_kernels(model)
    assert any("/CutlassFP8ScaledMMLinearKernelx" in p for p in picked), picked
    assert any(p.startswith("UnquantizedEmbeddingMethodx") for p in picked), picked
    assert vllm_version().startswith("0.33")


def test_the_cpu_gemm_dispatch_is_rebuilt_on_a_kept_weight() -> None:
    """``UnquantizedLinearMethod.process_weights_after_loading`` on the CPU platform sets
    ``cpu_linear`` through ``dispatch_cpu_unquantized_gemm``; where it kept the weight (the plain
    torch path this host takes), the rebuild sets the same callable and keeps the weight."""
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.utils.torch_utils import set_default_torch_dtype

    from engine_client.vllm.internals import CPU_GEMM_DISPATCH, rebuild_runtime, runtime_rebuilder

    with vllm_for(LLAMA), set_default_torch_dtype(torch.bfloat16):
        processed = ReplicatedLinear(64, 32, bias=False)
        processed.weight.data.normal_()
        processed.quant_method.process_weights_after_loading(processed)
        assert runtime_rebuilder(processed, "cpu_linear") == CPU_GEMM_DISPATCH
        assert runtime_rebuilder(processed, "something_else") is None
        rebuilt = ReplicatedLinear(64, 32, bias=False)
        rebuilt.weight = processed.weight
        rebuild_runtime(rebuilt, CPU_GEMM_DISPATCH)
    assert rebuilt.weight is processed.weight
    assert rebuilt.cpu_linear.__qualname__ == processed.cpu_linear.__qualname__
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(rebuilt.cpu_linear(x, rebuilt.weight, None), processed(x)[0])


# What an EngineCore does at its start (``EngineCore.run_engine_core``): vLLM's logging
# configured, then its general plugins loaded (ours among them, by its entry point); then the
# loader logs as it does when it donates, attaches, or serves its own load.
ENGINE_CORE_LOGS = """
import sys
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging, set_vllm_process_name
from vllm.plugins import load_general_plugins

set_vllm_process_name("EngineCore_DP0")
configure_logging(LoggingConfig())
load_general_plugins()
from engine_client.donations import ATTACHED_LOG, DONATED_LOG
from engine_client.fallback import FALLBACK_LOG, OWN_LOAD
from engine_client.vllm import donation_load

donation_load.log.info(DONATED_LOG, "donated-aa", 291)
donation_load.log.info(ATTACHED_LOG, "donated-bb", 291)
donation_load.log.warning(FALLBACK_LOG, OWN_LOAD, "donation_refused", "no room")
donation_load.log.debug("weight-cache: below vLLM's level")
"""


def test_the_loaders_lines_print_through_vllms_logging(tmp_path: Path) -> None:
    """vLLM's handler sits on its ``vllm`` logger alone: the loader's INFO lines reach an
    engine's output (as the restart proof reads them, with vLLM's process prefix) only as that
    logger's children (``log_through_vllm``, called by the plugin's ``register``)."""
    from tests.gpu import donation_lines, vllm_logs

    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LOGGING")}
    env.update(NO_COLOR="1", VLLM_CONFIGURE_LOGGING="1")
    env.pop("VLLM_PLUGINS", None)  # every general plugin, ours included
    done = run_python(ENGINE_CORE_LOGS, env=env, cwd=tmp_path, timeout=300)
    lines = [line for line in done.stdout.splitlines() if "weight-cache" in line]
    assert len(lines) == 3, done.stdout[-3000:] + done.stderr[-3000:]
    for line in lines:
        m = vllm_logs.PROCESS.match(line)
        assert m is not None and m.group(1) == "EngineCore_DP0", line
    found = [donation_lines.outcome([line]) for line in lines]
    assert found == [
        donation_lines.Outcome("donated", "donated-aa"),
        donation_lines.Outcome("attached", "donated-bb"),
        donation_lines.Outcome("own_load", reason="donation_refused", detail="no room"),
    ]
