"""The daemon's load of a checkpoint as the benchmarks drive it: ``load_model``, the daemon's own
code, into a CUDA or a shared-memory arena, outside a running daemon; one load, or two at once.

Two loads at once run on the shared loading pool as the daemon runs them, so the pair timing
shows whether concurrent loads share the pool fairly or contend.
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from protocol.devices import Placement
from protocol.schemas.manifest import DeviceKind
from service.memory.shm import ArenaDir
from service.registry.loader import LoadRequest, Progress, ResidentRank, load_model


def daemon_load(path: Path, device: torch.device, shm: Path, model_id: str) -> list[ResidentRank]:
    placement = (
        Placement(DeviceKind.cuda, device.index or 0)
        if device.type == "cuda"
        else Placement(DeviceKind.cpu)
    )
    request = LoadRequest.unmanaged(model_id, path, [placement], ArenaDir.prepare(shm))
    return load_model(request, Progress())


def release(ranks: list[ResidentRank]) -> None:
    for rank in ranks:
        rank.arena.release()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def pair_of_loads(path: Path, device: torch.device, shm: Path, repeats: int) -> dict[str, Any]:
    """Two loads of the checkpoint one after the other, and two at once (two threads, as the
    daemon runs two loads), ``repeats`` times each, alternating which goes first; medians."""

    def sequential() -> float:
        start = time.perf_counter()
        release(daemon_load(path, device, shm, "seq-a"))
        release(daemon_load(path, device, shm, "seq-b"))
        return time.perf_counter() - start

    def together() -> float:
        held: list[list[ResidentRank]] = []
        errors: list[BaseException] = []

        def run(model_id: str) -> None:
            try:
                held.append(daemon_load(path, device, shm, model_id))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(f"par-{i}",)) for i in range(2)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - start
        for ranks in held:
            release(ranks)
        if errors:
            raise errors[0]
        return seconds

    seq: list[float] = []
    par: list[float] = []
    for i in range(repeats):
        order = [(seq, sequential), (par, together)]
        for times, fn in order if i % 2 == 0 else order[::-1]:
            times.append(fn())
    return {
        "sequential_s": statistics.median(seq),
        "together_s": statistics.median(par),
        "sequential_all_s": seq,
        "together_all_s": par,
    }
