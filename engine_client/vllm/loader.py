"""vLLM 0.33 model loader for ``--load-format weight_cache``: attach to weights the weight-cache
daemon processed and holds, else fall back to vLLM's default loader and say why.

vLLM's worker drives a loader in this order, once per engine start, each call on a loader it
builds afresh: ``get_external_weight_memory`` in ``init_device`` (the loader's last call before
the model runner opens its load window), then ``load_model`` inside that window
(``DeviceMemoryProfiler``). The first runs the loader's before-window hook
(:func:`before_load_window`), then answers; the second runs :data:`LOAD_STEPS
<engine_client.vllm.load_steps.LOAD_STEPS>` and, if any fails, either falls back or raises
(``fallback``), decided once in :func:`engine_client.fallback.fall_back_or_raise`.

Options (``--model-loader-extra-config``, :class:`~engine_client.loader_options.LoaderOptions`):
``url``, ``uds``, ``token``, ``token_file``, ``model`` (the daemon's model id; default: the ready
model whose fingerprint matches), ``fallback`` (default true), ``identity`` (how the checkpoints
must match: ``files``, ``sampled`` (default), ``hf_blob`` or ``full``), ``timeout`` (seconds,
default 10), ``wait`` (seconds to wait for a daemon still loading the model, default 0),
``verify_checksums`` (default false), ``donate`` (:mod:`.donation_load`), ``handle_socket`` (the
daemon's handle socket where this engine sees it), ``park`` (wait before the load until the
daemon releases this engine), ``park_timeout``, ``startup_slot_timeout``
(:mod:`engine_client.vllm.startup`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from torch import nn
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.utils.torch_utils import set_default_torch_dtype

from engine_client.attach import Attachment
from engine_client.client import ClientConfig
from engine_client.fallback import FALLING_BACK, fall_back_or_raise, own_failure_after
from engine_client.loader_options import LoaderOptions
from engine_client.vllm.donation_load import (
    LoadInputs,
    attach_or_donate,
    donated_rank_bytes,
    donates,
)
from engine_client.vllm.engine_start import (
    daemon_model,
    rank_bytes,
    target_device,
)
from engine_client.vllm.internals import forget_build_on_error, freeze_startup_heap
from engine_client.vllm.load_steps import LOAD_STEPS, Load
from engine_client.vllm.startup import before_memory_snapshot, fit_standby_budget
from engine_client.vllm.steps import run_steps
from protocol.errors import VerificationError, WeightCacheError
from protocol.logsafe import get_logger
from protocol.reasons import Reason

__all__ = ["LOAD_FORMAT", "WeightCacheModelLoader", "before_load_window"]

log = get_logger(__name__)

LOAD_FORMAT = "weight_cache"


def before_load_window(
    options: LoaderOptions, config: ClientConfig, model_id: Callable[[], str]
) -> bool:
    """The loader's hooks just before vLLM's load window opens (and its memory snapshot is
    taken): with ``park``, wait until the daemon releases this engine; then take this GPU's
    start-up slot (:func:`.startup.before_memory_snapshot`). False when a park ended without a
    release: the load then falls back to its own weights."""
    ended = before_memory_snapshot(
        options,
        config,
        model_id,
        get_tensor_model_parallel_rank(),
        get_tensor_model_parallel_world_size(),
    )
    return ended is None


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
        self.donated: str | None = None  # the model this engine donated, if it did
        self.donation_error: WeightCacheError | None = None  # why it did not share
        self.fallback_reason: Reason | None = None

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
        """vLLM's worker calls this once per engine start, just before its memory snapshot and
        its load window, and as its last call to the loader before them: the loader's
        :func:`before_load_window` hooks run here, after the startup heap is frozen (so the
        window's full collections skip it: :func:`.internals.freeze_startup_heap`), then the
        question is answered by :meth:`daemon_rank_bytes` (0 for an engine whose park ended
        without a release). The daemon's model is asked before a park for its id and again
        after it: a park may last long enough for the daemon to restart or reload it."""
        freeze_startup_heap()
        try:
            config = self.options.client_config()
        except WeightCacheError:
            return 0  # an unreadable token file: the load reports it and falls back
        model_config = vllm_config.model_config
        if not before_load_window(
            self.options,
            config,
            lambda: daemon_model(config, self.options, vllm_config, model_config).id,
        ):
            return 0
        external = self.daemon_rank_bytes(vllm_config, config)
        fit_standby_budget(vllm_config.cache_config, external, config.standby_group is not None)
        return external

    def daemon_rank_bytes(self, vllm_config: Any, config: ClientConfig | None = None) -> int:
        """Weight bytes the daemon holds for this rank (outside the engine's allocator): its
        model of this checkpoint, else the donated model this engine will attach to; 0 where it
        holds none for this engine. The donated way is taken where the load takes it
        (:func:`.donation_load.donates`: a checkpoint the daemon does not process). Asks the
        daemon and changes nothing; what it reads of the checkpoint is kept for the load of this
        engine start."""
        model_config = vllm_config.model_config
        try:
            config = config or self.options.client_config()
            try:
                chosen = daemon_model(config, self.options, vllm_config, model_config)
            except WeightCacheError as exc:
                if not donates(exc, self.options):
                    return 0
                device = target_device(vllm_config)
                return donated_rank_bytes(vllm_config, model_config, config, device)
        except WeightCacheError:
            return 0
        return rank_bytes(chosen)

    def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> nn.Module:
        start = time.perf_counter()
        try:
            model = self._attach_model(vllm_config, model_config, prefix)
        except Exception as exc:
            reason = None  # a checkpoint the daemon does not process: the donated way
            if not donates(exc, self.options):
                reason = fall_back_or_raise(exc, self.options.fallback, FALLING_BACK)
        else:
            self._log_attached(start)
            return model
        # Outside the ``except``: what vLLM's own load raises is not chained onto ``exc``.
        if reason is None:
            return self._donated(vllm_config, model_config, prefix)
        self.fallback_reason = reason
        return self._fall_back(vllm_config, model_config, prefix, reason)

    def _donated(self, vllm_config: Any, model_config: Any, prefix: str) -> nn.Module:
        """A checkpoint the daemon does not process: attach to its donated model, else load it
        with vLLM's default loader and donate it (:mod:`.donation_load`)."""
        with set_default_torch_dtype(model_config.dtype):
            done = attach_or_donate(
                LoadInputs(
                    vllm_config,
                    model_config,
                    lambda: self.create_model(vllm_config, model_config, prefix),
                    lambda model: self._default().load_weights(model, model_config),
                    self.options.client_config(),
                    target_device(vllm_config),
                ),
                self.options.fallback,
            )
        self.attachment, self.donated, self.fallback_reason = (
            done.attachment,
            done.donated,
            done.reason,
        )
        self.donation_error = done.error
        evaluated: nn.Module = done.model.eval()
        return evaluated

    def _fall_back(
        self, vllm_config: Any, model_config: Any, prefix: str, reason: Reason
    ) -> nn.Module:
        """vLLM's default load; its failure is its own and names the fallback that led to it."""
        with own_failure_after(reason):
            fallback: nn.Module = self._default().load_model(vllm_config, model_config, prefix)
        return fallback

    def _log_attached(self, start: float) -> None:
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

    def _attach_model(self, vllm_config: Any, model_config: Any, prefix: str) -> nn.Module:
        load = Load(
            vllm_config,
            model_config,
            prefix,
            self.options,
            target_device(vllm_config),
            self.create_model,
        )
        with forget_build_on_error(vllm_config), set_default_torch_dtype(model_config.dtype):
            try:
                times = run_steps(LOAD_STEPS, load)
            except BaseException:
                load.release()  # before the fallback loads
                raise
        log.info("weight-cache: steps inside vLLM: %s", times)
        self.attachment = load.leased
        evaluated: nn.Module = load.built.eval()
        return evaluated
