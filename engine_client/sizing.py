"""The ``--gpu-memory-utilization`` that lets several engines beside the daemon's copy of the
weights give a GPU away, the weights counted once.

vLLM subtracts the weights an engine maps from the daemon from that engine's budget
(``get_external_weight_memory``), so one engine keeps the default loader's meaning of the
setting: the same KV cache. With N engines the copy is subtracted N times while it exists once;
each engine's budget must then hold its share of what is left plus the weights it is charged
for. What no budget holds: the daemon's own memory (its weights and context), each engine's CUDA
context and libraries' handles (made before vLLM's memory snapshot), and a spare.

    utilization = (weights + (total - daemon - spare - N x outside) / N) / total
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 1 << 30
# Per engine, beyond its budget: its CUDA context and the handles vLLM makes before its memory
# snapshot (about 0.5 GiB on an H100). Measured there (8B shape, one run of four engines and
# one of five): each EngineCore's whole process, context included, stayed 0.18 GiB under its
# budget, as the activation peak vLLM profiles inside the budget is freed before the KV cache
# takes the rest; 768 MiB here left 4.1 GiB of the GPU unused with four engines.
OUTSIDE_BUDGET_BYTES = 512 << 20
SPARE_BYTES = 512 << 20  # left free on the GPU


@dataclass(frozen=True)
class SharedSizing:
    engines: int
    utilization: float  # each engine's --gpu-memory-utilization
    engine_budget_bytes: int  # what each engine's budget leaves it beyond the weights


def shared_utilization(
    total_bytes: int,
    daemon_bytes: int,
    weight_bytes: int,
    engines: int,
    spare_bytes: int = SPARE_BYTES,
    outside_bytes: int = OUTSIDE_BUDGET_BYTES,
) -> SharedSizing:
    """Each of ``engines`` engines' utilization on a GPU of ``total_bytes`` where the daemon
    holds ``daemon_bytes`` (``weight_bytes`` of them the model's weights on this GPU, which vLLM
    charges every engine for)."""
    if engines < 1:
        raise ValueError("engines must be at least 1")
    share = (total_bytes - daemon_bytes - spare_bytes - engines * outside_bytes) // engines
    if share <= 0:
        raise ValueError(
            f"{engines} engines do not fit beside the daemon's {daemon_bytes / GIB:.2f} GiB on a "
            f"GPU of {total_bytes / GIB:.2f} GiB"
        )
    utilization = math.floor((weight_bytes + share) / total_bytes * 1e4) / 1e4
    budget = math.ceil(total_bytes * utilization) - weight_bytes
    return SharedSizing(engines, min(utilization, 1.0), budget)
