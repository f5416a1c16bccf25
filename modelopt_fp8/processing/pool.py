"""One bounded pool of loading threads that every load in the process shares.

Loads read with ``preadv`` and process with NumPy, both of which release the GIL, so a few
threads keep the cores busy. Sharing one pool (rather than a pool per load) means two loads at
once split the same workers instead of oversubscribing the machine: together they take as long
as one after the other, and the event loop keeps the core the daemon leaves it.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch


@dataclass
class _Shared:
    lock: threading.Lock = field(default_factory=threading.Lock)
    pool: ThreadPoolExecutor | None = None
    workers: int = 0


_shared = _Shared()


def shared_pool() -> tuple[ThreadPoolExecutor, int]:
    """The process's loading pool and its size, created on first use with as many workers as
    torch's intra-op setting (the daemon sets it to ``load_threads``, by default cores - 1)."""
    with _shared.lock:
        if _shared.pool is None:
            _shared.workers = max(1, torch.get_num_threads())
            _shared.pool = ThreadPoolExecutor(
                max_workers=_shared.workers, thread_name_prefix="weight-load"
            )
        return _shared.pool, _shared.workers
