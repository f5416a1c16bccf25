"""One bounded pool of loading threads that every load in the process shares.

Loads read with ``preadv`` and process with NumPy, both of which release the GIL, so a few
threads keep the cores busy. Sharing one pool (rather than a pool per load) means two loads at
once split the same workers instead of oversubscribing the machine: together they take as long
as one after the other, and the event loop keeps the core the daemon leaves it.

A process that serves requests beside its loads (the daemon) also lowers the loading threads'
CPU priority (:func:`set_loading_nice`): on a busy machine the kernel then runs a request the
moment it arrives rather than when a loading thread's time slice ends. Linux keeps a nice value
per thread, so only the loading threads are lowered.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from protocol.logsafe import get_logger

log = get_logger(__name__)

MAX_NICE = 19  # the lowest priority Linux schedules


@dataclass
class _Shared:
    lock: threading.Lock = field(default_factory=threading.Lock)
    pool: ThreadPoolExecutor | None = None
    workers: int = 0
    nice: int = 0  # added to the process's niceness in every loading thread


_shared = _Shared()


def set_loading_nice(nice: int) -> None:
    """Run loading threads ``nice`` steps below the process's priority (0: as the process).
    Threads already lowered stay as they are (an unprivileged thread cannot raise its priority
    again): call it before the first load."""
    if not 0 <= nice <= MAX_NICE:
        raise ValueError(f"a loading niceness is between 0 and {MAX_NICE}, not {nice}")
    with _shared.lock:
        _shared.nice = nice


def lower_priority() -> None:
    """Give the calling thread the loading threads' priority: the niceness of the process's
    main thread plus the configured step, at most 19. The pool's workers run it as they start;
    a thread that drives a load (planning, hashing) calls it too. Never raises: a platform
    without per-thread priorities loads at the process's priority."""
    step = _shared.nice
    if step <= 0 or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()
    try:
        # On Linux PRIO_PROCESS names a thread; the main thread's id is the process id.
        target = min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, os.getpid()) + step)
        if os.getpriority(os.PRIO_PROCESS, tid) < target:
            os.setpriority(os.PRIO_PROCESS, tid, target)
    except OSError as exc:
        log.warning("loading thread %d keeps its priority: %s", tid, exc)


def shared_pool() -> tuple[ThreadPoolExecutor, int]:
    """The process's loading pool and its size, created on first use with as many workers as
    torch's intra-op setting (the daemon sets it to ``load_threads``, by default cores - 1)."""
    with _shared.lock:
        if _shared.pool is None:
            _shared.workers = max(1, torch.get_num_threads())
            _shared.pool = ThreadPoolExecutor(
                max_workers=_shared.workers,
                thread_name_prefix="weight-load",
                initializer=lower_priority,
            )
        return _shared.pool, _shared.workers
