"""Measuring one step of a benchmark: wall time, the CPU time of every thread, and the device
synchronised before a clock is read, so queued GPU work is counted where it was queued.

Progress is printed as it happens (flushed), so a long run shows where it is.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from typing import Any

import torch


def log(message: str) -> None:
    print(message, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_seconds() -> float:
    """User + system CPU time of this process, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out
