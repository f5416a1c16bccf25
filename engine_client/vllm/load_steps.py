"""The attach inside vLLM's ``load_model``, step by step, after vLLM's own loader template
(``BaseModelLoader.load_model``: build the model, load its weights, process them), with the
load replaced by an attach and a bind:

0. **wait until released**: with ``park``, the release this engine parked for before vLLM's
   memory snapshot (:mod:`.startup`), or, if it did not park then, park now;
1. **find model**: the engine's expectations (its checkpoint's identity, read once per engine
   start, its device and TP rank) and the daemon's model for it;
2. **build on meta**: vLLM's model class, built on the meta device, holds no weight memory;
3. **check kernel**: every FP8 linear layer must have the kernel the daemon processed for;
4. **attach**: lease this rank's tensors from the daemon and verify them;
5. **bind**: every leased tensor becomes the parameter vLLM's default loader would have left;
6. **runtime state**: what vLLM's constructors compute rather than load is built on the target
   device by vLLM's own code, and the checkpoint's KV-cache scales go through its loaders;
7. **post-process**: vLLM's ``process_weights_after_loading`` for every module except the
   bound FP8 layers, then nothing may be left on the meta device.

A step is one line of :data:`LOAD_STEPS`: a name, a function of the :class:`Load`, and the
reason an unexpected failure in it is reported under.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn
from vllm.distributed import (
    get_pp_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from vllm.model_executor.model_loader.utils import process_weights_after_loading

from engine_client.attach import Attachment, attach_waiting
from engine_client.client import ClientConfig
from engine_client.loader_options import LoaderOptions
from engine_client.parking import ParkingSpot, released_for_this_load
from engine_client.verify import Expectations
from engine_client.vllm.binding import bind_attachment
from engine_client.vllm.engine_start import checkpoint_identity, daemon_model
from engine_client.vllm.internals import skip_post_processing
from engine_client.vllm.kernel_check import cutlass_layers, require_cutlass
from engine_client.vllm.runtime_state import (
    build_runtime_state,
    load_checkpoint_scales,
    require_materialized,
)
from engine_client.vllm.startup import engine_group
from engine_client.vllm.steps import Step
from modelopt_fp8.checkpoint import IdentityTier
from protocol.errors import VerificationError
from protocol.reasons import Reason

__all__ = ["LOAD_STEPS", "Load"]

T = TypeVar("T")


def _made_by_an_earlier_step(value: T | None, what: str) -> T:
    """``value``, which the step that makes it has set by now (a step out of order is a bug)."""
    if value is None:
        raise RuntimeError(f"no {what} yet: a step runs before the step that makes it")
    return value


@dataclass
class Load:
    """One attach in progress: what vLLM passed to ``load_model``, and what each step leaves
    for the next."""

    vllm_config: Any
    model_config: Any
    prefix: str
    options: LoaderOptions
    device: torch.device
    create_model: Callable[[Any, Any, str], nn.Module]  # the loader's (BaseModelLoader's)
    expect: Expectations | None = None
    model_id: str | None = None
    model: nn.Module | None = None
    attachment: Attachment | None = None
    checkpoint_scales: list[str] = field(default_factory=list)

    @functools.cached_property
    def client_config(self) -> ClientConfig:
        """How to reach the daemon, from the options (made on first use, by any step)."""
        return self.options.client_config()

    @property
    def built(self) -> nn.Module:
        return _made_by_an_earlier_step(self.model, "model")

    @property
    def leased(self) -> Attachment:
        return _made_by_an_earlier_step(self.attachment, "attachment")

    def release(self) -> None:
        """Give the lease back, if this load holds one (a load that failed after attaching)."""
        if self.attachment is not None:
            self.attachment.close()


def wait_until_released(load: Load) -> None:
    if not load.options.park:
        return
    rank, size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    tier = IdentityTier(load.options.identity)

    def spot() -> ParkingSpot:
        # The engine's own checkpoint first: one it cannot compare fails before any park.
        checkpoint_identity(load.vllm_config, load.model_config, tier)
        chosen = daemon_model(load.client_config, load.options, load.vllm_config, load.model_config)
        return ParkingSpot(chosen.id, rank, size, engine_group(), load.options.parks_if_serving)

    released_for_this_load(load.client_config, spot, load.options.park_timeout)


def find_model(load: Load) -> None:
    if get_pp_group().world_size != 1:
        raise VerificationError(
            "pipeline parallelism is not served", reason=Reason.pipeline_parallel
        )
    tier = IdentityTier(load.options.identity)
    identity = checkpoint_identity(load.vllm_config, load.model_config, tier)
    load.expect = Expectations.for_identity(
        identity,
        load.device,
        tp_rank=get_tensor_model_parallel_rank(),
        tp_size=get_tensor_model_parallel_world_size(),
        verify_checksums=load.options.verify_checksums,
    )
    chosen = daemon_model(load.client_config, load.options, load.vllm_config, load.model_config)
    load.model_id = chosen.id


def build_on_meta(load: Load) -> None:
    with torch.device("meta"):
        load.model = load.create_model(load.vllm_config, load.model_config, load.prefix)


def check_kernel(load: Load) -> None:
    require_cutlass(load.built)


def attach(load: Load) -> None:
    load.attachment = attach_waiting(
        _made_by_an_earlier_step(load.model_id, "model id"),
        _made_by_an_earlier_step(load.expect, "expectations"),
        load.client_config,
        load.options.wait,
    )


def bind(load: Load) -> None:
    load.checkpoint_scales = bind_attachment(load.built, load.leased)


def runtime_state(load: Load) -> None:
    build_runtime_state(load.built, load.device)
    load_checkpoint_scales(load.built, load.leased, load.checkpoint_scales)


def post_process(load: Load) -> None:
    """vLLM's post-load processing for everything but the bound FP8 linear layers, whose
    processed state the bind step set from the lease."""
    model = load.built
    with skip_post_processing(cutlass_layers(model)):
        process_weights_after_loading(model, load.model_config, load.device)
    require_materialized(model)


LOAD_STEPS: tuple[Step[Load], ...] = (
    Step("wait until released", wait_until_released),
    Step("find model", find_model),
    Step("build on meta", build_on_meta),
    Step("check kernel", check_kernel),
    Step("attach", attach),
    Step("bind", bind, Reason.bind_failed),
    Step("runtime state", runtime_state, Reason.bind_failed),
    Step("post-process", post_process, Reason.bind_failed),
)
