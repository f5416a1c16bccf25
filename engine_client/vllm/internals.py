"""Every place the ``weight_cache`` loader relies on vLLM 0.33's internals, and nowhere else.

The rest of :mod:`engine_client.vllm` uses vLLM's public loader API only (``BaseModelLoader``,
``register_model_loader``, ``DefaultModelLoader``, ``process_weights_after_loading``, the
distributed group getters, ``set_default_torch_dtype``). What follows is what vLLM's public API
does not offer: undoing what a model build registers process-wide, parameters rebuilt with
vLLM's parameter classes, the processed state vLLM's ModelOpt FP8 and CUTLASS code leave on a
layer, the state vLLM's constructors compute, where vLLM's logging prints, the garbage collector
around vLLM's load window, and the worker's warm-up that ends an engine's start-up. Each
function names the vLLM code it mirrors or depends on, and ``tests/vllm/test_internals.py``
(``test_startup_hooks.py`` for the warm-up) holds a test per touch that fails on a vLLM where it
no longer holds.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn
from vllm.model_executor.kernels.linear.scaled_mm.cutlass import CutlassFP8ScaledMMLinearKernel
from vllm.model_executor.layers import rotary_embedding
from vllm.model_executor.layers.attention.attention import set_default_quant_scales
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.utils.gc_utils import freeze_gc_heap

from protocol.logsafe import get_logger
from protocol.schemas.layout import Kernel, LayerLayout

log = get_logger(__name__)

# The parameters BaseKVCacheMethod.create_weights puts on an attention layer.
KV_SCALE_PARAMETERS = ("q_scale", "k_scale", "v_scale", "prob_scale")


def is_meta(tensor: object) -> bool:
    """A tensor still on the meta device (built, never given storage)."""
    return isinstance(tensor, torch.Tensor) and tensor.is_meta


# --- a model build, undone ------------------------------------------------------------------


@contextlib.contextmanager
def forget_build_on_error(vllm_config: Any) -> Iterator[None]:
    """Undo what building a model registers process-wide if the block fails, so vLLM's default
    loader can build the model again: the attention layers ``Attention.__init__`` enters in the
    config's ``compilation_config.static_forward_context`` (a second build of the same layer
    names would be refused), and the rotary embeddings ``get_rope`` caches in
    ``rotary_embedding._ROPE_DICT`` (built on the meta device, they would hand the fallback's
    model a meta ``cos_sin_cache``)."""
    context = vllm_config.compilation_config.static_forward_context
    layers_before = set(context)
    ropes_before = set(rotary_embedding._ROPE_DICT)
    try:
        yield
    except BaseException:
        for name in set(context) - layers_before:
            del context[name]
        for key in set(rotary_embedding._ROPE_DICT) - ropes_before:
            del rotary_embedding._ROPE_DICT[key]
        raise


# --- parameters -------------------------------------------------------------------------------


def parameter_like(old: nn.Parameter, tensor: torch.Tensor) -> nn.Parameter:
    """``tensor`` as a parameter of ``old``'s class, carrying ``old``'s loader attributes.

    vLLM's parameter classes (``BasevLLMParameter`` and its subclasses in
    ``vllm.model_executor.parameter``) keep their loader state (``weight_loader``, the sharding
    dims, ``tp_rank``) in the instance ``__dict__``, and ``replace_parameter``
    (``vllm.model_executor.utils``) keeps that object when it swaps the data. The meta
    parameter cannot take leased data in place, so a new object of the same class is made
    without running its ``__init__`` and given the same ``__dict__``."""
    new = nn.Parameter.__new__(type(old), tensor, False)
    new.__dict__.update(old.__dict__)
    return new


# --- FP8 linear layers ------------------------------------------------------------------------


def engine_kernel(module: nn.Module) -> str | None:
    """The scaled-mm kernel vLLM selected for a ModelOpt linear module (its ``quant_method``'s
    ``kernel``, chosen by ``select_linear_kernel``), as the daemon names it; None for a module
    without one."""
    kernel = getattr(getattr(module, "quant_method", None), "kernel", None)
    if kernel is None:
        return None
    if type(kernel) is CutlassFP8ScaledMMLinearKernel:
        return Kernel.cutlass.value
    return type(kernel).__name__


class LinearShape(NamedTuple):
    """A linear layer's size on this rank as vLLM built it: the fused output widths and K."""

    logical_widths: list[int]
    input_size: int | None


def linear_shape(module: nn.Module) -> LinearShape | None:
    """What ``LinearBase.__init__`` and the ModelOpt method's ``create_weights`` record
    (``logical_widths``, ``input_size_per_partition``); None for a module without them."""
    widths = getattr(module, "logical_widths", None)
    if widths is None:
        return None
    return LinearShape(list(widths), getattr(module, "input_size_per_partition", None))


def set_processed_state(module: Any, layout: LayerLayout) -> None:
    """The plain attributes vLLM's post-load processing leaves on a ModelOpt FP8 linear layer
    for the CUTLASS kernel, set from the lease instead of computed: ``processed_weight_dims``
    (set by the ModelOpt weight schemes' ``process``), ``is_w4a16_nvfp4`` (set by
    ``ModelOptLinearMethod.process_weights_after_loading``), the kernel's
    ``logical_output_size`` and, for a padded layer, the weight's ``weight_loader`` pointed at
    the kernel's ``padded_weight_loader`` (both set by
    ``CutlassFP8ScaledMMLinearKernel.process_weights_after_loading``)."""
    module.processed_weight_dims = layout.processed_weight_dims
    module.is_w4a16_nvfp4 = False
    kernel = module.quant_method.kernel
    kernel.logical_output_size = layout.output_size
    padded = (layout.padded_input_size, layout.padded_output_size) != (
        layout.input_size,
        layout.output_size,
    )
    if padded:
        module.weight.weight_loader = kernel.padded_weight_loader


@contextlib.contextmanager
def skip_post_processing(modules: Iterable[Any]) -> Iterator[None]:
    """Inside the block, ``process_weights_after_loading`` (``model_loader.utils``) leaves
    ``modules`` as they are: it only processes modules whose ``quant_method`` is a
    ``QuantizeMethodBase``, so each gets a stand-in for the block. What it would have done
    after processing them, ``update_param_tp_status``, is done here."""
    modules = list(modules)
    methods = [m.quant_method for m in modules]
    for m in modules:
        m.quant_method = _AlreadyProcessed()
        if hasattr(m, "update_param_tp_status"):
            m.update_param_tp_status()
    try:
        yield
    finally:
        for m, method in zip(modules, methods, strict=True):
            m.quant_method = method


class _AlreadyProcessed:
    """Stands in for a bound layer's quant method while vLLM post-processes the rest."""

    requires_device_loading = False
    supports_pre_processed_weights = True

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass


# --- vocabulary-parallel modules ------------------------------------------------------------


class VocabShard(NamedTuple):
    """How ``VocabParallelEmbedding.__init__`` shards and pads the vocabulary on this rank."""

    vocab_size: int
    start: int
    end: int
    padding_size: int
    added_embeddings: int


def vocab_shard(module: nn.Module) -> VocabShard | None:
    """This rank's vocabulary shard of a ``VocabParallelEmbedding`` (or ``ParallelLMHead``), read
    from its ``shard_indices``; None for any other module."""
    if not isinstance(module, VocabParallelEmbedding):
        return None
    shard = module.shard_indices
    return VocabShard(
        module.org_vocab_size,
        shard.org_vocab_start_index,
        shard.org_vocab_end_index,
        module.padding_size,
        module.num_added_embeddings,
    )


# --- state vLLM's constructors compute ------------------------------------------------------


def has_meta_rotary_cache(module: nn.Module) -> bool:
    """A rotary embedding built on the meta device (``RotaryEmbedding`` and its subclasses
    register ``cos_sin_cache`` as a buffer computed by ``_compute_cos_sin_cache``)."""
    return is_meta(module._buffers.get("cos_sin_cache")) and hasattr(
        module, "_compute_cos_sin_cache"
    )


def rebuild_rotary_cache(module: Any) -> None:
    """The cos/sin cache as ``RotaryEmbedding.__init__`` computes it (on the current default
    device, in the module's dtype unless FlashInfer keeps it in float32), and the bfloat16 copy
    some rotary classes keep beside it."""
    cache = module._compute_cos_sin_cache()
    if not getattr(module, "use_flashinfer", False):
        cache = cache.to(module.dtype)
    module._buffers["cos_sin_cache"] = cache
    if is_meta(module._buffers.get("cos_sin_cache_bf16")):
        module._buffers["cos_sin_cache_bf16"] = cache.to(torch.bfloat16)


def has_meta_attention_scales(module: nn.Module) -> bool:
    """An attention layer built on the meta device (``set_default_quant_scales`` registers its
    ``_k_scale`` buffer)."""
    return is_meta(module._buffers.get("_k_scale"))


def rebuild_attention_state(module: Any) -> None:
    """The scale buffers and host copies ``Attention.__init__`` creates with
    ``set_default_quant_scales``, its empty ``kv_cache`` placeholder, and the KV-cache scale
    parameters its ``BaseKVCacheMethod`` creates in ``create_weights``."""
    set_default_quant_scales(module, register_buffer=True)
    if is_meta(getattr(module, "kv_cache", None)):
        module.kv_cache = torch.tensor([])
    method = getattr(module, "quant_method", None)
    if isinstance(method, BaseKVCacheMethod) and any(
        is_meta(module._parameters.get(name)) for name in KV_SCALE_PARAMETERS
    ):
        method.create_weights(module)


# --- where the loader's log lines go ---------------------------------------------------------

VLLM_LOGGER = "vllm"  # the logger vLLM's logging configuration puts its handler on
PROJECT_LOGGERS = ("engine_client", "protocol")  # the project's loggers inside an engine


def log_through_vllm() -> None:
    """Make the project's loggers children of vLLM's: vLLM's logging configuration
    (``vllm.logger.DEFAULT_LOGGING_CONFIG``) puts its handler and level on the ``vllm`` logger
    alone, which does not propagate, so a record of any other logger meets no handler and only
    its warnings reach the output (bare, through ``logging.lastResort``). As vLLM's children the
    loader's lines (that it attached, donated, the time of its steps) print at vLLM's level, with
    its format and process prefix, in every process vLLM configures, whenever it does."""
    parent = logging.getLogger(VLLM_LOGGER)
    for name in PROJECT_LOGGERS:
        logging.getLogger(name).parent = parent


# --- the garbage collector around vLLM's load window --------------------------------------------


def freeze_startup_heap() -> None:
    """Freeze every object alive now with ``freeze_gc_heap`` (``vllm.utils.gc_utils``), as
    vLLM's engine core does once initialised, so the full collections the model runner's
    ``DeviceMemoryProfiler`` runs around the load (one on entering, two on leaving: about 0.4 s
    each over an 8B engine's startup heap, all inside the time vLLM reports as "Model loading
    took" with the V2 model runner) skip it. It must run before that window opens: inside it,
    the entering collection would already have walked the whole heap."""
    freeze_gc_heap()


# --- the end of an engine's start-up ------------------------------------------------------------

_after_warm_up: list[Callable[[], None]] = []
_WRAPPED = "_weight_cache_wraps"


def after_warm_up(callback: Callable[[], None]) -> None:
    """Call ``callback`` once this process's vLLM worker has finished (or failed) its
    ``compile_or_warm_up_model`` (``vllm.v1.worker.gpu_worker.Worker``), which
    ``EngineCore._initialize_kv_caches`` calls after profiling and allocating the KV cache, and
    which captures the CUDA graphs: the last thing an engine's start-up allocates. vLLM offers
    no hook there, so the worker's method is wrapped, once per process."""
    from vllm.v1.worker.gpu_worker import Worker

    _after_warm_up.append(callback)
    current = Worker.compile_or_warm_up_model
    if getattr(current, _WRAPPED, None) is not None:
        return

    @functools.wraps(current)
    def compile_or_warm_up_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return current(self, *args, **kwargs)
        finally:
            while _after_warm_up:
                done = _after_warm_up.pop(0)
                try:
                    done()
                except Exception:
                    log.exception("weight-cache: after vLLM's warm-up")

    setattr(compile_or_warm_up_model, _WRAPPED, current)
    Worker.compile_or_warm_up_model = compile_or_warm_up_model


# --- what vLLM's memory profiling sees ------------------------------------------------------------


def _device_index(device: Any) -> int:
    if device is None:
        return int(torch.cuda.current_device())
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return int(device.index) if device.index is not None else int(torch.cuda.current_device())


def see_only_own_memory(
    own_used: Callable[[], int | None], device_index: int
) -> Callable[[], None]:
    """Until the returned function is called, ``torch.accelerator.get_memory_info`` answers
    for this process alone on ``device_index``: the free memory of this moment less what this
    process has taken since (``own_used``: its bytes as the driver counts them). vLLM sizes the
    KV cache from that call: ``MemorySnapshot.measure`` (``vllm.utils.mem_utils``; the worker's
    init snapshot, and ``memory_profiling`` before and after its profile run, whose difference
    ``determine_available_memory`` takes as the engine's own consumption) and
    ``GPUModelRunner.profile_cudagraph_memory``. Read globally, another engine starting on the
    same GPU meanwhile (its CUDA context, its KV cache) counts as this one's and can leave it a
    negative KV cache; one that ends meanwhile (its memory freed) fails vLLM's check that free
    memory did not grow. Where ``own_used`` cannot say, vLLM's reading stands."""
    original = torch.accelerator.get_memory_info
    baseline_free, total = original(device_index)
    baseline_own = own_used()
    if baseline_own is None:
        return lambda: None

    def private(device: Any = None) -> tuple[int, int]:
        if _device_index(device) != device_index:
            return original(device)
        own = own_used()
        if own is None:
            return original(device)
        return max(0, baseline_free - (own - baseline_own)), total

    torch.accelerator.get_memory_info = private

    def restore() -> None:
        if torch.accelerator.get_memory_info is private:
            torch.accelerator.get_memory_info = original

    return restore


# --- donated models -----------------------------------------------------------------------------


def vllm_version() -> str:
    """The vLLM a donation was processed by (``vllm.__version__``)."""
    import vllm

    return str(vllm.__version__)


def picked_kernels(model: nn.Module) -> list[str]:
    """What vLLM picked for every module with a quant method: the method's class and, where it
    chose one (``select_linear_kernel`` and the MoE kernel selection keep it as the method's
    ``kernel``), the kernel's class; each with how many modules use it, sorted."""
    counts: dict[str, int] = {}
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        kernel = getattr(method, "kernel", None)
        name = type(method).__name__ + (f"/{type(kernel).__name__}" if kernel is not None else "")
        counts[name] = counts.get(name, 0) + 1
    return sorted(f"{name}x{count}" for name, count in counts.items())


def kernel_of(module: nn.Module) -> object | None:
    """The kernel object a module's quant method chose (its attributes are part of what
    processing sets), or None."""
    return getattr(getattr(module, "quant_method", None), "kernel", None)


# Attributes vLLM's processing sets to a callable that an engine attaching to a donation rebuilds
# with vLLM's own code, by the name the donation records.
CPU_GEMM_DISPATCH = "cpu_gemm_dispatch"


def runtime_rebuilder(module: nn.Module, attribute: str) -> str | None:
    """The rebuilder (by name) for a callable processing left on ``module``, or None where this
    loader cannot rebuild it: ``cpu_linear``, set on the CPU platform by
    ``UnquantizedLinearMethod.process_weights_after_loading`` through
    ``dispatch_cpu_unquantized_gemm``, while the layer keeps its weight (the plain torch
    fallback; a packed weight lives outside any tensor and is not donated)."""
    weight = getattr(module, "weight", None)
    if attribute == "cpu_linear" and isinstance(weight, torch.Tensor) and weight.numel() > 0:
        return CPU_GEMM_DISPATCH
    return None


def rebuild_runtime(module: nn.Module, rebuilder: str) -> None:
    """Rebuild what ``rebuilder`` names on ``module`` (bound to the donated weight): vLLM's
    ``dispatch_cpu_unquantized_gemm`` keeping the weight, as processing left it."""
    if rebuilder != CPU_GEMM_DISPATCH:
        raise ValueError(f"no rebuilder {rebuilder!r}")
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch_cpu_unquantized_gemm(module, remove_weight=False)
