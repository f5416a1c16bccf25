"""vLLM 0.33 model loader for ``--load-format weight_cache``.

The model is built on the meta device (no weight memory), every linear layer is bound to the
leased, already-processed tensors under vLLM's own parameter names, the remaining tensors
(embeddings, norms, KV-cache scales) are loaded through vLLM's own weight loaders from the lease,
and vLLM's post-load processing runs for every module except the leased ModelOpt FP8 linear
layers, whose processed state (the ``[K, N]`` weight view, 0-dim or padded scales,
``processed_weight_dims`` and the CUTLASS kernel's logical output width) is set directly: nothing
is transposed, requantized or padded again, and nothing writes into leased memory.

Without the daemon, or when anything does not match, it falls back to vLLM's default loader and
logs why (``fallback: false`` in the extra config makes that an error instead).

Options (``--model-loader-extra-config``): ``url``, ``uds``, ``token``, ``token_file``,
``model`` (the daemon's model id; default: the ready model whose fingerprint matches),
``fallback`` (default true), ``timeout`` (seconds, default 10), ``wait`` (seconds to wait for a
daemon still loading the model, default 0), ``verify_checksums`` (default false).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from engine_client.attach import Attachment
from engine_client.client import ClientConfig, DaemonClient
from engine_client.loading import attach_waiting, record_fallback
from engine_client.verify import Expectations, Reason
from service.checkpoint import Fingerprint, checkpoint_fingerprint
from service.errors import (
    ModelNotFoundError,
    VerificationError,
    WeightCacheError,
)
from service.schemas.layout import Kernel, Scheme
from service.schemas.models import ModelState

log = logging.getLogger(__name__)

LOAD_FORMAT = "weight_cache"
CUTLASS_KERNEL_CLASS = "CutlassFP8ScaledMMLinearKernel"


class LoaderOptions(BaseModel):
    """``--model-loader-extra-config`` keys; anything else is refused."""

    model_config = ConfigDict(extra="forbid")

    url: str | None = None
    uds: str | None = None
    token: str | None = None
    token_file: str | None = None
    model: str | None = None
    fallback: bool = True
    timeout: float = Field(default=10.0, gt=0)
    wait: float = Field(default=0.0, ge=0)
    verify_checksums: bool = False

    def client_config(self) -> ClientConfig:
        return ClientConfig.from_env(
            self.token_file, url=self.url, uds=self.uds, token=self.token, timeout_s=self.timeout
        )


def engine_kernel(module: nn.Module) -> str | None:
    """The scaled-mm kernel vLLM selected for a ModelOpt linear module, as the daemon names it."""
    kernel = getattr(getattr(module, "quant_method", None), "kernel", None)
    if kernel is None:
        return None
    name = type(kernel).__name__
    return Kernel.cutlass.value if name == CUTLASS_KERNEL_CLASS else name


def _as_parameter(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def _set_param(module: nn.Module, leaf: str, tensor: torch.Tensor | None) -> None:
    module._parameters.pop(leaf, None)
    module._buffers.pop(leaf, None)
    if tensor is not None:
        module.register_parameter(leaf, _as_parameter(tensor))


class _AlreadyProcessed:
    """Stands in for a bound layer's quant method while vLLM post-processes the rest."""

    requires_device_loading = False
    supports_pre_processed_weights = True

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass


def bind_attachment(model: nn.Module, attachment: Attachment) -> list[str]:
    """Bind every leased linear layer to its vLLM module; return the carried tensor names.

    Sets on each FP8 layer exactly what ``process_weights_after_loading`` would have left.
    """
    modules = dict(model.named_modules())
    for layout in attachment.layers:
        module = modules.get(layout.name)
        if module is None:
            raise VerificationError(
                f"vLLM's model has no module {layout.name}",
                reason=Reason.manifest_invalid.value,
                layer=layout.name,
            )
        t = attachment.tensors
        _set_param(module, "weight", t[layout.weight])
        if layout.bias is not None:
            _set_param(module, "bias", t[layout.bias])
        if layout.scheme is Scheme.unquantized:
            continue
        _set_param(module, "weight_scale", t[layout.weight_scale or ""])
        _set_param(module, "input_scale", t[layout.input_scale] if layout.input_scale else None)
        module.processed_weight_dims = layout.processed_weight_dims
        module.is_w4a16_nvfp4 = False
        if engine_kernel(module) == Kernel.cutlass.value:
            module.quant_method.kernel.logical_output_size = layout.output_size
    bound = {name for layout in attachment.layers for name in layout.tensor_names()}
    return [name for name in attachment.tensors if name not in bound]


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Give every tensor still on the meta device real (empty) memory, keeping parameter classes
    and their loader attributes; rotary caches are recomputed, as vLLM builds them."""
    for module in model.modules():
        for leaf, param in list(module._parameters.items()):
            if param is not None and param.device.type == "meta":
                # The subclass (with its weight_loader) without re-running its constructor.
                real = nn.Parameter.__new__(
                    type(param), torch.empty_like(param, device=device), False
                )
                real.__dict__.update(param.__dict__)
                module._parameters[leaf] = real
        for leaf, buf in list(module._buffers.items()):
            if buf is None or buf.device.type != "meta":
                continue
            compute = cast(
                Callable[[], torch.Tensor] | None, getattr(module, "_compute_cos_sin_cache", None)
            )
            if leaf == "cos_sin_cache" and compute is not None:
                module._buffers[leaf] = compute().to(device, buf.dtype)
            else:
                module._buffers[leaf] = torch.empty_like(buf, device=device)


@contextlib.contextmanager
def _forget_build_on_error(vllm_config: Any) -> Iterator[None]:
    """Undo what building a model registers process-wide, if the attach then fails, so the
    fallback can build the model again: attention layers in the config's forward context, and
    rotary embeddings vLLM caches (which, built on the meta device, would hand the fallback's
    model a meta ``cos_sin_cache``)."""
    from vllm.model_executor.layers import rotary_embedding

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


@functools.cache
def _register() -> type:
    """Define and register the loader class, once (vLLM is imported only here)."""
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.utils import (
        initialize_model,
        process_weights_after_loading,
    )
    from vllm.utils.torch_utils import set_default_torch_dtype

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

        def _default(self) -> Any:
            return DefaultModelLoader(self.fallback_config)

        def download_model(self, model_config: Any) -> None:
            self._default().download_model(model_config)

        def load_weights(self, model: nn.Module, model_config: Any) -> None:
            # In-place reloads (RL refits) read the checkpoint as vLLM always does.
            self._default().load_weights(model, model_config)

        def get_external_weight_memory(self, vllm_config: Any) -> int:
            """Weight bytes held by the daemon for this rank (not in the engine's allocator)."""
            try:
                config = self.options.client_config()
                _, rank_bytes = self._daemon_model(vllm_config.model_config, config)
            except WeightCacheError:
                return 0
            return rank_bytes

        def _daemon_model(
            self, model_config: Any, config: ClientConfig, fingerprint: Fingerprint | None = None
        ) -> tuple[str, int]:
            """The daemon's model for this engine: the one named in the options, else the
            ready (or loading) one of this checkpoint at this TP size; and its bytes per rank."""
            from vllm.distributed import get_tensor_model_parallel_world_size

            tp_size = get_tensor_model_parallel_world_size()
            with DaemonClient(config) as client:
                models = client.models()
            if self.options.model:
                chosen = [m for m in models if m.id == self.options.model]
            else:
                fingerprint = fingerprint or checkpoint_fingerprint(Path(model_config.model))
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
            except WeightCacheError as exc:
                if not self.options.fallback:
                    raise
                self.fallback_reason = record_fallback(exc, "falling back to vLLM's default loader")
                fallback: nn.Module = self._default().load_model(vllm_config, model_config, prefix)
                return fallback
            log.info(
                "weight-cache: attached %d tensors (%.1f MiB) in %.1f ms",
                len(self.attachment.tensors) if self.attachment else 0,
                (self.attachment.nbytes if self.attachment else 0) / 2**20,
                (time.perf_counter() - start) * 1e3,
            )
            return model

        def _attach_model(self, vllm_config: Any, model_config: Any, prefix: str) -> nn.Module:
            from vllm.distributed import (
                get_pp_group,
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )

            if get_pp_group().world_size != 1:
                raise VerificationError(
                    "pipeline parallelism is not served", reason=Reason.pipeline_parallel.value
                )
            checkpoint = Path(model_config.model)
            if not checkpoint.is_dir():
                raise VerificationError(
                    f"{checkpoint} is not a local checkpoint directory",
                    reason=Reason.not_local_checkpoint.value,
                )
            device = torch.device(vllm_config.device_config.device)
            if device.type == "cuda" and device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            expect = Expectations.for_checkpoint(
                checkpoint,
                device,
                tp_rank=get_tensor_model_parallel_rank(),
                tp_size=get_tensor_model_parallel_world_size(),
                verify_checksums=self.options.verify_checksums,
            )
            config = self.options.client_config()
            model_id, _ = self._daemon_model(model_config, config, expect.fingerprint)
            with set_default_torch_dtype(model_config.dtype), torch.device("meta"):
                model = initialize_model(
                    vllm_config=vllm_config, model_config=model_config, prefix=prefix
                )
            kernels = {engine_kernel(m) for m in model.modules()} - {None, Kernel.cutlass.value}
            if kernels:
                raise VerificationError(
                    f"vLLM selected {', '.join(sorted(k for k in kernels if k))} for this "
                    "model; the daemon processed for cutlass",
                    reason=Reason.kernel_mismatch.value,
                )
            attachment = attach_waiting(model_id, expect, config, self.options.wait)
            try:
                carried = bind_attachment(model, attachment)
                _materialize(model, device)
                with set_default_torch_dtype(model_config.dtype):
                    model.load_weights((name, attachment.tensors[name]) for name in carried)
                bound = [m for m in model.modules() if engine_kernel(m) == Kernel.cutlass.value]
                methods = [m.quant_method for m in bound]
                for m in bound:
                    m.quant_method = _AlreadyProcessed()
                try:
                    process_weights_after_loading(model, model_config, device)
                finally:
                    for m, method in zip(bound, methods, strict=True):
                        m.quant_method = method
            except BaseException as exc:
                attachment.close()
                if isinstance(exc, WeightCacheError) or not isinstance(exc, Exception):
                    raise
                # vLLM disagreed with the lease: say so, then fall back.
                raise VerificationError(
                    f"binding the lease to vLLM's model failed: {type(exc).__name__}: {exc}",
                    reason=Reason.manifest_invalid.value,
                ) from exc
            self.attachment = attachment
            evaluated: nn.Module = model.eval()
            return evaluated

    return WeightCacheModelLoader
