"""Handing freed heap memory back to the system after a load.

A load allocates and frees tens of megabytes of transient buffers (headers, plans, the pieces of
a refused header). glibc keeps freed chunks in its heaps for reuse, and raises its ``mmap``
threshold after freeing a large mapped block, so later large buffers come from the heap too: a
refused 16 MiB header left 40 MB resident for good. ``malloc_trim`` gives every free page of
every heap back to the kernel; it is called once a load fails or is cancelled, so what a
client's checkpoint made the daemon allocate does not stay (a load that succeeds leaves what the
next one reuses, and trimming every heap while requests are served costs them latency). Elsewhere
than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    return trim


def give_back_freed_memory() -> None:
    """Return the heaps' free pages to the kernel (glibc's ``malloc_trim(0)``)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
