"""vLLM 0.33 model loader for ``--load-format weight_cache``.

It follows vLLM's own template (``model_loader/base_loader.py``: build, load, process), with the
load replaced by an attach:

1. **build on meta**: vLLM's model class, built on the meta device, holds no weight memory;
2. **require CUTLASS**: every FP8 linear layer must have the kernel the daemon processed for;
3. **attach**: lease this rank's tensors from the daemon and verify them (:mod:`.attach`);
4. **bind**: every leased tensor becomes the parameter vLLM's default loader would have left,
   zero-copy: the linear layers in their processed ``[K, N]`` form with their scales, the
   embeddings and LM head as this rank's padded vocabulary rows, the norms. Each keeps vLLM's
   parameter class and loader attributes, and parameters vLLM shares (a tied LM head) stay one;
5. **runtime state**: what vLLM's constructors compute rather than load (rotary caches, the
   attention layers' scale buffers, KV-cache scale parameters) is built on the target device
   by vLLM's own code, and the checkpoint's KV-cache scales go through vLLM's weight loaders;
6. **post-process**: vLLM's ``process_weights_after_loading`` runs for every module except the
   leased FP8 linear layers, whose processed state (``processed_weight_dims``, the CUTLASS
   kernel's logical output width) is set from the lease: nothing is transposed, requantized or
   padded again, and nothing writes into leased memory.

Any failure on the way (no daemon, a refused or mismatching lease, an arena that cannot be
opened, a model vLLM built differently) falls back to vLLM's default loader with the reason
logged and counted; ``fallback: false`` raises it, typed, instead.

Options (``--model-loader-extra-config``): ``url``, ``uds``, ``token``, ``token_file``,
``model`` (the daemon's model id; default: the ready model whose fingerprint matches),
``fallback`` (default true), ``identity`` (how the checkpoints must match: ``files``,
``sampled`` (default), ``hf_blob`` or ``full``), ``timeout`` (seconds, default 10), ``wait``
(seconds to wait for a daemon still loading the model, default 0), ``verify_checksums``
(default false).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from vllm.distributed import (
    get_pp_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from vllm.model_executor.layers import rotary_embedding
from vllm.model_executor.layers.attention.attention import set_default_quant_scales
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.utils.gc_utils import freeze_gc_heap
from vllm.utils.torch_utils import set_default_torch_dtype

from engine_client.attach import Attachment, attach_waiting
from engine_client.client import ClientConfig, DaemonClient
from engine_client.fallback import as_weight_cache_error, record_fallback
from engine_client.loader_options import LoaderOptions
from engine_client.verify import Expectations
from modelopt_fp8.checkpoint import Fingerprint, IdentityTier, checkpoint_fingerprint
from modelopt_fp8.checkpoint.locate import local_checkpoint
from protocol.errors import (
    ModelNotFoundError,
    VerificationError,
    WeightCacheError,
)
from protocol.reasons import Reason
from protocol.schemas.layout import CarriedKind, CarriedLayout, Kernel, LayerLayout, Scheme
from protocol.schemas.models import ModelState

log = logging.getLogger(__name__)

LOAD_FORMAT = "weight_cache"
CUTLASS_KERNEL_CLASS = "CutlassFP8ScaledMMLinearKernel"
KV_SCALE_PARAMETERS = ("q_scale", "k_scale", "v_scale", "prob_scale")


def engine_kernel(module: nn.Module) -> str | None:
    """The scaled-mm kernel vLLM selected for a ModelOpt linear module, as the daemon names it."""
    kernel = getattr(getattr(module, "quant_method", None), "kernel", None)
    if kernel is None:
        return None
    name = type(kernel).__name__
    return Kernel.cutlass.value if name == CUTLASS_KERNEL_CLASS else name


def require_cutlass(model: nn.Module) -> None:
    """Refuse a model whose FP8 layers vLLM gave another kernel than the daemon processed for."""
    kernels = {engine_kernel(m) for m in model.modules()} - {None, Kernel.cutlass.value}
    if kernels:
        raise VerificationError(
            f"vLLM selected {', '.join(sorted(k for k in kernels if k))} for this model; the "
            "daemon processed for cutlass",
            reason=Reason.kernel_mismatch.value,
        )


class _AlreadyProcessed:
    """Stands in for a bound layer's quant method while vLLM post-processes the rest."""

    requires_device_loading = False
    supports_pre_processed_weights = True

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass


# --- bind ---------------------------------------------------------------------------------------


class _Parameters:
    """Every place a parameter sits in the model, so one tensor replaces it everywhere (a tied
    LM head is ``embed_tokens.weight`` itself, registered in two modules)."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = dict(model.named_modules(remove_duplicate=False))
        self.by_name: dict[str, nn.Parameter] = {}
        self.places: dict[int, list[tuple[nn.Module, str]]] = {}
        for module_name, module in self.modules.items():
            for leaf, param in module._parameters.items():
                if param is None:
                    continue
                name = f"{module_name}.{leaf}" if module_name else leaf
                self.by_name[name] = param
                self.places.setdefault(id(param), []).append((module, leaf))

    def module(self, name: str) -> Any:
        """The vLLM module ``name`` (typed loosely: its attributes are vLLM's)."""
        module = self.modules.get(name)
        if module is None:
            raise _layout_error(f"vLLM's model has no module {name}", layer=name)
        return module

    def replace(self, module: nn.Module, leaf: str, tensor: torch.Tensor | None) -> None:
        """Put ``tensor`` where ``module.leaf`` is, as a parameter of the same class with the
        same loader attributes (what ``replace_parameter`` keeps); None removes it."""
        old = module._parameters.get(leaf)
        if tensor is None:
            if old is not None:
                setattr(module, leaf, None)
            return
        if old is None:
            module.register_parameter(leaf, nn.Parameter(tensor, requires_grad=False))
            return
        new = nn.Parameter.__new__(type(old), tensor, False)
        new.__dict__.update(old.__dict__)
        for place, place_leaf in self.places.pop(id(old), [(module, leaf)]):
            place._parameters[place_leaf] = new
        self.places[id(new)] = [(module, leaf)]

    def bind(self, name: str, tensor: torch.Tensor) -> None:
        """Bind a whole tensor under vLLM's parameter ``name``; dtype and shape must agree."""
        param = self.by_name.get(name)
        if param is None:
            raise _layout_error(f"vLLM's model has no parameter {name}", tensor=name)
        if param.dtype != tensor.dtype or param.shape != tensor.shape:
            raise _layout_error(
                f"{name}: vLLM holds {param.dtype} {list(param.shape)}, the lease "
                f"{tensor.dtype} {list(tensor.shape)}",
                tensor=name,
            )
        module_name, _, leaf = name.rpartition(".")
        self.replace(self.modules[module_name], leaf, tensor)


def _layout_error(detail: str, **extra: object) -> VerificationError:
    return VerificationError(detail, reason=Reason.layout_mismatch.value, **extra)


def _check_linear_shape(module: nn.Module, layout: LayerLayout) -> None:
    """The leased layer must be the layer vLLM built: same fused widths on this rank."""
    widths = getattr(module, "logical_widths", None)
    k = getattr(module, "input_size_per_partition", None)
    if widths is not None and (list(widths) != layout.logical_widths or k != layout.input_size):
        raise _layout_error(
            f"{layout.name}: vLLM built widths {list(widths)} x {k}, the lease holds "
            f"{layout.logical_widths} x {layout.input_size}",
            layer=layout.name,
        )


def bind_linear(params: _Parameters, layout: LayerLayout, tensors: dict[str, torch.Tensor]) -> None:
    """Leave on one linear layer exactly what ``process_weights_after_loading`` would have."""
    module = params.module(layout.name)
    _check_linear_shape(module, layout)
    params.replace(module, "weight", tensors[layout.weight])
    if layout.bias is not None:
        params.replace(module, "bias", tensors[layout.bias])
    if layout.scheme is Scheme.unquantized:
        return
    params.replace(module, "weight_scale", tensors[layout.weight_scale or ""])
    params.replace(
        module, "input_scale", tensors[layout.input_scale] if layout.input_scale else None
    )
    module.processed_weight_dims = layout.processed_weight_dims
    module.is_w4a16_nvfp4 = False
    kernel = module.quant_method.kernel
    kernel.logical_output_size = layout.output_size
    padded = (layout.padded_input_size, layout.padded_output_size) != (
        layout.input_size,
        layout.output_size,
    )
    if padded:  # CUTLASS' padding step points reloads at its padded loader (cutlass.py:227)
        module.weight.weight_loader = kernel.padded_weight_loader


def _check_vocab_shard(module: nn.Module, layout: CarriedLayout) -> None:
    if not isinstance(module, VocabParallelEmbedding):
        raise _layout_error(f"{layout.name} is not a vocabulary-parallel module in vLLM")
    shard = module.shard_indices
    ours = (layout.vocab_size, layout.vocab_start, layout.vocab_end, layout.padding_size)
    theirs = (
        module.org_vocab_size,
        shard.org_vocab_start_index,
        shard.org_vocab_end_index,
        module.padding_size,
    )
    if ours != theirs or module.num_added_embeddings:
        raise _layout_error(
            f"{layout.name}: vLLM shards the vocabulary as (size, start, end, padding) "
            f"{theirs}, the lease {ours}",
            tensor=layout.name,
        )


def bind_attachment(model: nn.Module, attachment: Attachment) -> list[str]:
    """Bind every leased tensor vLLM holds as is; return the names its loaders must consume
    (the checkpoint's KV-cache scales)."""
    params = _Parameters(model)
    manifest = attachment.manifest
    for layout in manifest.layers:
        bind_linear(params, layout, attachment.tensors)
    to_load = []
    for carried in manifest.carried:
        if carried.kind is CarriedKind.checkpoint:
            to_load.append(carried.name)
            continue
        if carried.kind is CarriedKind.vocab_parallel:
            _check_vocab_shard(params.module(carried.name.rpartition(".")[0]), carried)
        params.bind(carried.name, attachment.tensors[carried.name])
    return to_load


# --- runtime state --------------------------------------------------------------------------------


def _is_meta(tensor: object) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.is_meta


def _rebuild_rotary(module: Any) -> None:
    """The cos/sin cache as ``RotaryEmbedding.__init__`` computes it (on the current default
    device, in the module's dtype unless FlashInfer keeps it in float32)."""
    cache = module._compute_cos_sin_cache()
    if not getattr(module, "use_flashinfer", False):
        cache = cache.to(module.dtype)
    module._buffers["cos_sin_cache"] = cache
    if _is_meta(module._buffers.get("cos_sin_cache_bf16")):
        module._buffers["cos_sin_cache_bf16"] = cache.to(torch.bfloat16)


def _rebuild_attention(module: Any) -> None:
    """The scale buffers, host copies and KV-cache scale parameters ``Attention.__init__`` and
    its KV-cache quant method create (``attention.py:133-205, 464``; ``kv_cache.py:62-73``)."""
    set_default_quant_scales(module, register_buffer=True)
    if _is_meta(getattr(module, "kv_cache", None)):
        module.kv_cache = torch.tensor([])
    method = getattr(module, "quant_method", None)
    if isinstance(method, BaseKVCacheMethod) and any(
        _is_meta(module._parameters.get(name)) for name in KV_SCALE_PARAMETERS
    ):
        method.create_weights(module)


def build_runtime_state(model: nn.Module, device: torch.device) -> None:
    """Build, on ``device`` and with vLLM's own code, the tensors its constructors compute
    rather than load; everything else must already be bound."""
    with torch.device(device):
        for module in model.modules():
            if _is_meta(module._buffers.get("cos_sin_cache")) and hasattr(
                module, "_compute_cos_sin_cache"
            ):
                _rebuild_rotary(module)
            if _is_meta(module._buffers.get("_k_scale")):
                _rebuild_attention(module)


def meta_tensors(model: nn.Module) -> list[str]:
    """Names of every parameter, buffer or tensor attribute still on the meta device."""
    left: list[str] = []
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for key, value in vars(module).items():
            if key in ("_parameters", "_buffers"):
                found = [(k, v) for k, v in value.items() if _is_meta(v)]
            else:
                found = [(key, value)] if _is_meta(value) else []
            left.extend(prefix + k for k, _ in found)
    return left


def require_materialized(model: nn.Module) -> None:
    """Refuse a model that still holds meta tensors: the lease or vLLM's constructors would
    have had to provide them, so this vLLM built something this loader does not serve."""
    left = meta_tensors(model)
    if left:
        shown = ", ".join(left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
        raise VerificationError(
            f"the lease and vLLM's constructors leave {shown} unset",
            reason=Reason.unsupported_module.value,
        )


# --- post-process ---------------------------------------------------------------------------------


def post_process(model: nn.Module, model_config: Any, device: torch.device) -> None:
    """vLLM's post-load processing for everything but the bound FP8 linear layers."""
    bound: list[Any] = [m for m in model.modules() if engine_kernel(m) == Kernel.cutlass.value]
    methods = [m.quant_method for m in bound]
    for m in bound:
        m.quant_method = _AlreadyProcessed()
        if hasattr(m, "update_param_tp_status"):
            m.update_param_tp_status()
    try:
        process_weights_after_loading(model, model_config, device)
    finally:
        for m, method in zip(bound, methods, strict=True):
            m.quant_method = method


@contextlib.contextmanager
def _forget_build_on_error(vllm_config: Any) -> Iterator[None]:
    """Undo what building a model registers process-wide, if the attach then fails, so the
    fallback can build the model again: attention layers in the config's forward context, and
    rotary embeddings vLLM caches (which, built on the meta device, would hand the fallback's
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


def _checkpoint_dir(model_config: Any) -> Path:
    """The directory vLLM's model name stands for: the directory itself, or a Hugging Face repo
    id vLLM reads from the local cache (as the daemon resolves its --model), at the revision
    vLLM was given."""
    checkpoint = local_checkpoint(model_config.model, getattr(model_config, "revision", None))
    if checkpoint is None:
        raise VerificationError(
            f"{model_config.model} is neither a local checkpoint directory nor a Hugging Face "
            "repo in the local cache",
            reason=Reason.not_local_checkpoint.value,
        )
    return checkpoint


def _target_device(vllm_config: Any) -> torch.device:
    load_device = vllm_config.load_config.device or vllm_config.device_config.device
    device = torch.device(load_device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


@register_model_loader(LOAD_FORMAT)
class WeightCacheModelLoader(BaseModelLoader):  # type: ignore[misc]
    """Attach to weights processed and held by the weight-cache daemon."""

    def __init__(self, load_config: Any) -> None:
        super().__init__(load_config)
        self.options = LoaderOptions.model_validate(
            dict(load_config.model_loader_extra_config or {})
        )
        self.fallback_config = dataclasses.replace(
            load_config, load_format="auto", model_loader_extra_config={}
        )
        self.attachment: Attachment | None = None
        self.fallback_reason: str | None = None

    def _default(self) -> DefaultModelLoader:
        return DefaultModelLoader(self.fallback_config)

    def download_model(self, model_config: Any) -> None:
        self._default().download_model(model_config)

    def load_weights(self, model: nn.Module, model_config: Any) -> None:
        """In-place reloads (RL refits) read the checkpoint as vLLM always does; leased
        weights are shared with the daemon and other engines, so they are never written."""
        if self.attachment is not None and not self.attachment.closed:
            raise VerificationError(
                "this model's weights are leased from the weight-cache daemon and shared; "
                "reload it with vLLM's default load format instead",
                reason=Reason.leased_read_only,
            )
        self._default().load_weights(model, model_config)

    def get_external_weight_memory(self, vllm_config: Any) -> int:
        """Weight bytes held by the daemon for this rank (not in the engine's allocator).

        vLLM asks this in the worker just before it loads the model, inside a window that runs
        three full garbage collections over the startup heap (``DeviceMemoryProfiler``: about
        0.4 s each on an 8B engine, more than the attach itself). The startup heap is frozen
        here, as vLLM's engine core freezes it once initialised (``freeze_gc_heap``,
        ``v1/engine/core.py:243``), so those collections skip it.
        """
        freeze_gc_heap()
        try:
            config = self.options.client_config()
            _, rank_bytes = self._daemon_model(vllm_config.model_config, config)
        except WeightCacheError:
            return 0
        return rank_bytes

    def _daemon_model(
        self, model_config: Any, config: ClientConfig, fingerprint: Fingerprint | None = None
    ) -> tuple[str, int]:
        """The daemon's model for this engine: the one named in the options, else the ready
        (or loading) one of this checkpoint at this TP size; and its bytes per rank."""
        tp_size = get_tensor_model_parallel_world_size()
        with DaemonClient(config) as client:
            models = client.models()
        if self.options.model:
            chosen = [m for m in models if m.id == self.options.model]
        else:
            fingerprint = fingerprint or checkpoint_fingerprint(
                _checkpoint_dir(model_config), IdentityTier(self.options.identity)
            )
            chosen = [
                m
                for m in models
                if fingerprint.matches(m.digests)
                and m.state in (ModelState.ready, ModelState.loading)
                and m.tp_size == tp_size
            ]
        if not chosen:
            raise ModelNotFoundError(
                f"the daemon holds no model for {model_config.model} at tp_size {tp_size}"
            )
        return chosen[0].id, chosen[0].bytes_resident // max(1, chosen[0].tp_size)

    def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> nn.Module:
        start = time.perf_counter()
        try:
            with _forget_build_on_error(vllm_config):
                model = self._attach_model(vllm_config, model_config, prefix)
        except Exception as exc:
            error = as_weight_cache_error(exc)
            if not self.options.fallback:
                if error is exc:
                    raise
                raise error from exc
            self.fallback_reason = record_fallback(error, "falling back to vLLM's default loader")
            fallback: nn.Module = self._default().load_model(vllm_config, model_config, prefix)
            return fallback
        attachment = self.attachment
        assert attachment is not None
        log.info(
            "weight-cache: attached %d tensors (%.1f MiB) in %.1f ms (lease %.1f ms, open "
            "%.1f ms, rebuild %.1f ms)",
            len(attachment.tensors),
            attachment.nbytes / 2**20,
            (time.perf_counter() - start) * 1e3,
            attachment.timings.lease_ms,
            attachment.timings.open_ms,
            attachment.timings.rebuild_ms,
        )
        return model

    def _expectations(self, model_config: Any, device: torch.device) -> Expectations:
        if get_pp_group().world_size != 1:
            raise VerificationError(
                "pipeline parallelism is not served", reason=Reason.pipeline_parallel.value
            )
        return Expectations.for_checkpoint(
            _checkpoint_dir(model_config),
            device,
            IdentityTier(self.options.identity),
            tp_rank=get_tensor_model_parallel_rank(),
            tp_size=get_tensor_model_parallel_world_size(),
            verify_checksums=self.options.verify_checksums,
        )

    def _attach_model(self, vllm_config: Any, model_config: Any, prefix: str) -> nn.Module:
        steps = _Steps()
        device = _target_device(vllm_config)
        expect = self._expectations(model_config, device)
        config = self.options.client_config()
        model_id, _ = self._daemon_model(model_config, config, expect.fingerprint)
        steps.done("find model")
        with set_default_torch_dtype(model_config.dtype):
            with torch.device("meta"):
                model = self.create_model(vllm_config, model_config, prefix)
            require_cutlass(model)
            steps.done("build on meta")
            attachment = attach_waiting(model_id, expect, config, self.options.wait)
            steps.done("attach")
            try:
                to_load = bind_attachment(model, attachment)
                steps.done("bind")
                build_runtime_state(model, device)
                model.load_weights((name, attachment.tensors[name]) for name in to_load)
                steps.done("runtime state")
                post_process(model, model_config, device)
                require_materialized(model)
                steps.done("post-process")
            except BaseException as exc:
                attachment.close()
                if isinstance(exc, Exception):
                    raise as_weight_cache_error(exc, Reason.bind_failed) from exc
                raise
        log.info("weight-cache: steps inside vLLM: %s", steps)
        self.attachment = attachment
        evaluated: nn.Module = model.eval()
        return evaluated


class _Steps:
    """Milliseconds per step of an attach, for the log line that says where the time went."""

    def __init__(self) -> None:
        self.last = time.perf_counter()
        self.times: list[tuple[str, float]] = []

    def done(self, step: str) -> None:
        now = time.perf_counter()
        self.times.append((step, (now - self.last) * 1e3))
        self.last = now

    def __str__(self) -> str:
        return ", ".join(f"{step} {ms:.1f} ms" for step, ms in self.times)
