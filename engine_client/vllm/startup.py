"""What an engine does at vLLM 0.33's start-up before its weights load: park until released,
then take its GPU's start-up slot. Where in vLLM's worker this happens, and why
(``tests/vllm/test_startup_hooks.py`` fails where these stop holding):

- ``Worker.init_device`` creates the CUDA context (and, at TP > 1, NCCL's buffers), then asks the
  loader for its external weight memory (``get_external_weight_memory``), then takes the memory
  snapshot (``MemorySnapshot``) that ``request_memory`` checks ``gpu_memory_utilization``
  against, and that ``determine_available_memory`` later asserts free memory has not grown
  past. So an engine parks inside that question: its snapshot is taken once it is released,
  when the engine it replaces has freed its memory (parked before it, the snapshot would see
  that engine's KV cache: refused by ``request_memory``, or failing the assertion once it is
  freed). The driver frees a killed engine's memory seconds after its process is gone, so a
  released engine first waits for that (:mod:`engine_client.freed_memory`). And it takes its
  GPU's start-up slot there, just before the snapshot.
- ``EngineCore._initialize_kv_caches`` profiles (``determine_available_memory``), allocates the
  KV cache (``initialize_from_config``) and then captures CUDA graphs
  (``compile_or_warm_up_model``): the slot is given back when the worker's
  ``compile_or_warm_up_model`` returns (or raises), when nothing the engine allocates at
  start-up is left to count against the next one.
- From the moment the slot is held until the warm-up ends, vLLM's reading of free GPU memory
  sees this process's own use alone (:func:`.internals.see_only_own_memory`): engines that start,
  end or wake beside it (their contexts created before they queue for the slot, a killed
  engine's memory freed, a standby's KV cache allocated) change nothing in its sizing. A donor's
  own use includes the weights it gave the daemon (:func:`counted_as_own`).
- A warm standby started while another engine holds most of the GPU (``weight-cache standby``
  sets ``WEIGHT_CACHE_STANDBY_GROUP``) lowers its budget to what is free
  (:func:`fit_standby_budget`), rather than being refused by ``request_memory``: it takes over
  with a smaller KV cache.
- The TP ranks of one engine share a group id, broadcast from rank 0 over vLLM's TP group.
"""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Callable
from typing import Any

import torch

from engine_client.client import ClientConfig
from engine_client.donations import bytes_donated_here
from engine_client.freed_memory import wait_for_this_gpu
from engine_client.gpu_room import DeviceProcesses
from engine_client.loader_options import LoaderOptions
from engine_client.parking import ParkingSpot, park_ahead
from engine_client.startup_slot import take_startup_slot
from engine_client.vllm.internals import after_warm_up, see_only_own_memory
from protocol.devices import cuda_uuid, host_id
from protocol.errors import WeightCacheError
from protocol.logsafe import get_logger

log = get_logger(__name__)

_group: list[str] = []  # this engine's group id, once agreed on


def engine_group() -> str:
    """An id the TP ranks of this engine share (rank 0's, broadcast over vLLM's TP group: a
    collective every rank must reach, once per process; later calls reuse it)."""
    if _group:
        return _group[0]
    from vllm.distributed import get_tensor_model_parallel_world_size, get_tp_group

    group = f"{os.getpid()}.{secrets.token_hex(6)}"
    if get_tensor_model_parallel_world_size() > 1:
        group = str(get_tp_group().broadcast_object(group, src=0))
    _group.append(group)
    return group


def this_device() -> str:
    """The name the daemon keys start-up slots by: this worker's GPU's UUID, else the host."""
    if torch.cuda.is_available():
        return cuda_uuid(torch.cuda.current_device())
    return host_id()


def before_memory_snapshot(
    options: LoaderOptions,
    config: ClientConfig,
    model_id: Callable[[], str],
    tp_rank: int,
    tp_size: int,
) -> WeightCacheError | None:
    """Park until released (if ``park``), then take this GPU's start-up slot (unless
    ``startup_slot_timeout`` is 0), given back after warm-up. Returns why the park ended
    without a release when the engine is to fall back; raises it when it is not."""
    group = engine_group() if options.park or options.startup_slot_timeout > 0 else ""
    ended: WeightCacheError | None = None
    if options.park:
        ended = park_ahead(
            config,
            lambda: ParkingSpot(model_id(), tp_rank, tp_size, group, options.parks_if_serving),
            options.park_timeout,
        )
        if ended is not None and not options.fallback:
            raise ended
        if ended is None and torch.cuda.is_available():
            wait_for_this_gpu()
    if options.startup_slot_timeout > 0 and torch.cuda.is_available():
        slot = take_startup_slot(
            config, this_device(), group, tp_rank, tp_size, options.startup_slot_timeout
        )
        if slot is not None:
            after_warm_up(slot.give_back)
    if torch.cuda.is_available():
        see_own_memory_while_sizing()
    return ended


def see_own_memory_while_sizing() -> None:
    """vLLM's readings of free memory see this process's own use alone until its warm-up ends
    (:func:`.internals.see_only_own_memory`), where NVML counts this process."""
    index = torch.cuda.current_device()
    usage = DeviceProcesses.open(cuda_uuid(index))
    if usage is None or usage.own() is None:  # not listed, or its bytes not counted
        if usage is not None:
            usage.close()
        log.warning(
            "weight-cache: NVML does not count this process here: vLLM sizes this engine's KV "
            "cache from the whole GPU's free memory, which engines starting or ending beside "
            "it change"
        )
        return
    restore = see_only_own_memory(counted_as_own(usage.own), index)

    def done() -> None:
        restore()
        usage.close()

    after_warm_up(done)


def counted_as_own(driver_count: Callable[[], int | None]) -> Callable[[], int | None]:
    """This process's bytes as its KV sizing counts them: the driver's count, plus the weights
    it donated (:func:`~engine_client.donations.bytes_donated_here`: held by the daemon since,
    so that a donor's KV cache is the default loader's at the same utilization)."""

    def own() -> int | None:
        counted = driver_count()
        return None if counted is None else counted + bytes_donated_here()

    return own


# Kept free beside a standby fitted into what is left of a GPU: allocator rounding, cuBLAS and
# NCCL workspaces vLLM does not count.
STANDBY_SPARE_BYTES = 1 << 30


def fit_standby_budget(cache_config: Any, external_bytes: int, standby: bool) -> None:
    """A warm standby started while another engine holds the GPU: if its
    ``gpu_memory_utilization`` asks for more than is free (vLLM's ``request_memory`` would
    refuse it), lower it to what is free, so the standby starts, sizes its KV cache in that
    room and sleeps; it takes over with that smaller KV cache. Nothing changes for an engine
    that fits, one with ``--kv-cache-memory``, or one that is no standby."""
    if not standby or not torch.cuda.is_available() or cache_config.kv_cache_memory_bytes:
        return
    free, total = (int(x) for x in torch.cuda.mem_get_info())
    utilization = float(cache_config.gpu_memory_utilization)
    budget = math.ceil(total * utilization) - external_bytes
    if free >= budget:
        return
    room = free - STANDBY_SPARE_BYTES
    if room <= 0:
        return  # nothing to fit into: vLLM's own refusal says so
    fitted = math.floor((room + external_bytes) / total * 1e4) / 1e4
    cache_config.gpu_memory_utilization = fitted
    log.warning(
        "weight-cache standby: %.2f GiB free beside the engines on this GPU, less than this "
        "engine's budget of %.2f GiB: --gpu-memory-utilization %.4f lowered to %.4f, so it "
        "starts with a smaller KV cache and takes over with it (start the standby before the "
        "serving engine to give it a full one)",
        free / 2**30,
        budget / 2**30,
        utilization,
        fitted,
    )
