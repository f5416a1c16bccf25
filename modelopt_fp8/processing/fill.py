"""Filling processed storages, in the shared loading threads.

A load is a list of jobs (one per layer or carried tensor, described as rows in :mod:`.rows`),
run on the shared loading pool, largest first. Where a storage lives decides how it is filled:

* on a GPU (:mod:`.cuda_fill`): the raw rows go up and the GPU checks, pads and requantizes;
* in host memory or a shared-memory arena file (here): a thread fills one storage in chunks
  small enough to stay in cache: it reads the rows of a chunk with one ``preadv`` into a buffer
  it owns, checks them for NaN and infinity, requantizes them (the table gathers into a second
  buffer), hashes them (the manifest's xxh3, fed chunk by chunk), and hands the chunk to the
  destination: one copy into a tensor, or ``pwrite`` into the arena file (the daemon never maps,
  and page-faults, the arena).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait

import numpy as np
import torch
import xxhash

from modelopt_fp8.processing.cuda_fill import fill_on_gpu
from modelopt_fp8.processing.integrity import has_non_finite
from modelopt_fp8.processing.pool import shared_pool
from modelopt_fp8.processing.rows import (
    Bytes,
    Destination,
    FileRange,
    Fill,
    Job,
    OnProgress,
    RowFill,
    Stopped,
    chunk_rows,
    read_rows,
)
from modelopt_fp8.processing.source import SourceFiles
from protocol.errors import CorruptFileError

HOST_CHUNK_BYTES = 1 << 20  # read, checked, requantized, hashed and written while in cache
IN_PLACE_CHUNK_BYTES = 4 << 20  # filled in a tensor (fewer, larger reads; no copy to keep in cache)


class _Worker(threading.local):
    """Per loading thread: the chunk being prepared and scratch for requantized reads."""

    def __init__(self) -> None:
        self.chunk = np.empty(HOST_CHUNK_BYTES, dtype=np.uint8)
        self.scratch = np.empty(HOST_CHUNK_BYTES, dtype=np.uint8)

    def chunk_of(self, nbytes: int) -> Bytes:
        if self.chunk.size < nbytes:
            self.chunk = np.empty(nbytes, dtype=np.uint8)
        return self.chunk[:nbytes]

    def scratch_of(self, nbytes: int) -> Bytes:
        if self.scratch.size < nbytes:
            self.scratch = np.empty(nbytes, dtype=np.uint8)
        return self.scratch[:nbytes]


_worker = _Worker()


class _HostSink:
    """Where one host storage's chunks go: a tensor's memory or a range of an arena file."""

    def __init__(self, dest: Destination) -> None:
        self.dest = dest
        self.host: Bytes | None = None
        if isinstance(dest, torch.Tensor):
            self.host = dest.reshape(-1).view(torch.uint8).numpy()

    def commit(self, buf: Bytes, offset: int) -> None:
        """Write the prepared ``buf`` at byte ``offset`` of the storage."""
        if self.host is not None:
            self.host[offset : offset + buf.size] = buf
        else:
            assert isinstance(self.dest, FileRange)
            _pwrite_all(self.dest.fd, buf, self.dest.offset + offset)


def _pwrite_all(fd: int, buf: Bytes, offset: int) -> None:
    view = buf.data
    while view.nbytes:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


# --- filling -------------------------------------------------------------------------------------


def _fill_chunk(src: SourceFiles, fill: RowFill, start: int, buf: Bytes) -> None:
    """Storage rows ``start..start+len(buf)`` into ``buf`` ``[n, row_bytes]``: segment rows read
    in place (or into scratch and through the code map), zeros around, every read byte checked."""
    end = start + buf.shape[0]
    covered = np.zeros(buf.shape[0], dtype=bool)
    for seg in fill.segments:
        lo, hi = max(start, seg.dest_row), min(end, seg.dest_row + seg.rows)
        if lo >= hi:
            continue
        s = seg.source
        rows = buf[lo - start : hi - start]
        covered[lo - start : hi - start] = True
        if s.width < fill.row_bytes:
            rows[:, s.width :] = 0
        first = s.first_row + (lo - seg.dest_row)
        if s.code_map is None:  # straight into place; the zeros beside it pass the check
            read_rows(src, s, first, rows[:, : s.width])
            checked = rows
        else:
            checked = _worker.scratch_of((hi - lo) * s.width).reshape(hi - lo, s.width)
            read_rows(src, s, first, checked)
        if has_non_finite(checked, s.dtype):
            raise CorruptFileError(
                "tensor data holds NaN or infinite values", file=s.file, tensor=s.tensor
            )
        if s.code_map is not None:
            s.code_map.apply(checked, rows[:, : s.width])
    if not covered.all():
        buf[~covered] = 0


def _fill_rows(src: SourceFiles, fill: RowFill, sink: _HostSink, stop: threading.Event) -> str:
    """Fill one storage; returns the xxh3 of its bytes. A tensor's chunks are filled in place
    (the reads land in the tensor: no copy); an arena file's in the thread's chunk, then
    written."""
    digest = xxhash.xxh3_64()
    host = sink.host  # a tensor's bytes: filled in place
    chunk_bytes = HOST_CHUNK_BYTES if host is None else IN_PLACE_CHUNK_BYTES
    for start, end in chunk_rows(fill.rows, fill.row_bytes, chunk_bytes):
        if stop.is_set():
            raise Stopped
        first, nbytes = start * fill.row_bytes, (end - start) * fill.row_bytes
        buf = _worker.chunk_of(nbytes) if host is None else host[first : first + nbytes]
        _fill_chunk(src, fill, start, buf.reshape(end - start, fill.row_bytes))
        digest.update(buf.data)
        if host is None:
            sink.commit(buf, first)
    return digest.hexdigest()


def _fill_on_host(
    src: SourceFiles, fills: Sequence[Fill], dests: dict[str, Destination], stop: threading.Event
) -> dict[str, str]:
    checksums = {}
    for fill in fills:
        sink = _HostSink(dests[fill.spec.name])
        if isinstance(fill, RowFill):
            checksums[fill.spec.name] = _fill_rows(src, fill, sink, stop)
        else:
            data = fill.host_bytes()
            sink.commit(data, 0)
            checksums[fill.spec.name] = xxhash.xxh3_64_hexdigest(data.data)
    return checksums


def _device_of(dest: Destination) -> torch.device | None:
    if isinstance(dest, torch.Tensor) and dest.device.type == "cuda":
        return dest.device
    return None


def _run_job(
    src: SourceFiles, job: Job, dests: dict[str, Destination], stop: threading.Event
) -> dict[str, str]:
    fills = job.fills()
    device = _device_of(dests[job.specs[0].name])
    if device is not None:
        return fill_on_gpu(src, fills, dests, device, stop)
    return _fill_on_host(src, fills, dests, stop)


def run_jobs(
    src: SourceFiles,
    jobs: Sequence[Job],
    dests: dict[str, Destination],
    progress: OnProgress | None = None,
) -> dict[str, str]:
    """Run ``jobs`` on the shared pool, largest first and at most as many at once as it has
    workers (so loads running together take turns); returns every storage's checksum. On
    failure (or when ``progress`` raises, to cancel) the jobs under way stop before this
    returns, so the caller may free the destinations."""
    pool, workers = shared_pool()
    devices = {d for d in map(_device_of, dests.values()) if d is not None}
    for device in devices:  # the destinations were allocated on the caller's stream
        torch.cuda.current_stream(device).synchronize()
    queue = iter(sorted(jobs, key=lambda j: j.nbytes, reverse=True))
    stop = threading.Event()
    running: dict[Future[dict[str, str]], Job] = {}
    checksums: dict[str, str] = {}
    try:
        while True:
            while len(running) < workers and (job := next(queue, None)) is not None:
                running[pool.submit(_run_job, src, job, dests, stop)] = job
            if not running:
                break
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                job = running.pop(future)
                checksums.update(future.result())
                if progress:
                    progress(job.nbytes, len(job.specs))
    except BaseException:
        stop.set()
        wait(running)
        raise
    for device in devices:
        torch.cuda.synchronize(device)
    return checksums
