"""Filling processed storages, in the shared loading threads.

A processed tensor is described as rows: each storage seen as ``[rows, row_bytes]`` is a list of
row segments copied from checkpoint tensors (sliced by columns for tensor parallelism, mapped
through a code table when requantized), with zeros wherever no segment lies (CUTLASS padding).
A thread fills one storage in chunks small enough to stay in cache: it reads the rows of a chunk
with one ``preadv`` into a buffer it owns, checks them for NaN and infinity, requantizes them
(the table gathers into a second buffer), hashes them (the manifest's xxh3, fed chunk by chunk),
and hands the chunk to the destination:

* host memory (a fresh tensor): one copy;
* a shared-memory arena file: ``pwrite``, so the daemon never maps (and page-faults) the arena;
* a GPU: the chunk is prepared in one of two pinned buffers and copied asynchronously on the
  thread's own stream while the next chunk is prepared in the other.

Every step releases the GIL (``preadv``, ``pwrite``, NumPy, xxhash, CUDA copies), so a few
threads keep the cores or the PCIe link busy.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
import xxhash

from modelopt_fp8.processing.fp8 import CodeMap
from modelopt_fp8.processing.integrity import has_non_finite
from modelopt_fp8.processing.plan import TensorSpec
from modelopt_fp8.processing.pool import shared_pool
from modelopt_fp8.processing.source import SourceFiles
from protocol.errors import CorruptFileError

Bytes = npt.NDArray[np.uint8]
OnProgress = Callable[[int, int], None]  # (bytes written, tensors written) since the last call

HOST_CHUNK_BYTES = 1 << 20  # read, checked, requantized, hashed and written while in cache
STAGE_BYTES = 4 << 20  # a pinned buffer for copies to a GPU (two per loading thread)


@dataclass(frozen=True)
class FileRange:
    """A storage's bytes inside a file (a shared-memory arena), written with ``pwrite``."""

    fd: int
    offset: int
    nbytes: int


Destination = torch.Tensor | FileRange


@dataclass(frozen=True)
class RowSource:
    """Rows of a checkpoint tensor seen as ``[rows, row_bytes]``: from ``first_row`` on, the
    byte columns ``cols`` of each row, mapped through ``code_map`` when requantized."""

    tensor: str
    file: str
    dtype: torch.dtype
    row_bytes: int
    first_row: int
    cols: tuple[int, int]
    code_map: CodeMap | None = None

    @property
    def width(self) -> int:
        return self.cols[1] - self.cols[0]


@dataclass(frozen=True)
class Segment:
    """``rows`` storage rows from ``dest_row`` on come from ``source``, left-aligned; the rest
    of each row is zero."""

    dest_row: int
    rows: int
    source: RowSource


@dataclass(frozen=True)
class RowFill:
    """A storage seen as ``[rows, row_bytes]``: its segments, and zeros wherever none lies."""

    spec: TensorSpec
    rows: int
    row_bytes: int
    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class SmallFill:
    """A small tensor computed on the host (fused scales)."""

    spec: TensorSpec
    make: Callable[[], torch.Tensor]


Fill = RowFill | SmallFill


@dataclass(frozen=True)
class Job:
    """The tensors of one layer (or one carried tensor): a unit of work and of progress. Its
    fills are worked out by the loading thread that runs it (requantization maps cost a
    fraction of a millisecond each: not a serial step before the load)."""

    specs: tuple[TensorSpec, ...]
    fills: Callable[[], tuple[Fill, ...]]

    @property
    def nbytes(self) -> int:
        return sum(spec.nbytes for spec in self.specs)


def storage_rows(spec: TensorSpec) -> tuple[int, int]:
    """A storage as rows: ``(rows, bytes per row)`` (a 0-dim tensor is one row)."""
    shape = spec.storage_shape
    if not shape:
        return 1, spec.dtype.itemsize
    row_bytes = spec.dtype.itemsize
    for d in shape[1:]:
        row_bytes *= d
    return shape[0], row_bytes


# --- per-thread buffers and destinations ---------------------------------------------------------


class _Stopped(Exception):
    """Another part of the load failed or was cancelled: stop between chunks."""


class _Staging:
    """A loading thread's two pinned buffers and its stream for copies to one GPU: a chunk is
    prepared in one buffer while the other is on its way."""

    def __init__(self, device: torch.device, nbytes: int) -> None:
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self.nbytes = nbytes
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.arrays: list[Bytes] = [b.numpy() for b in self.buffers]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def take(self) -> int:
        """The next buffer, once its last copy is done."""
        i = self.turn
        self.turn ^= 1
        event = self.events[i]
        if event is not None:
            event.synchronize()
            self.events[i] = None
        return i

    def upload(self, i: int, nbytes: int, dst: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            dst.copy_(self.buffers[i][:nbytes], non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.stream)
        self.events[i] = event

    def drain(self) -> None:
        for i, event in enumerate(self.events):
            if event is not None:
                event.synchronize()
                self.events[i] = None


class _Worker(threading.local):
    """Per loading thread: the chunk being prepared, scratch for requantized reads, a sink
    for the columns a sliced read skips, and GPU staging."""

    def __init__(self) -> None:
        self.chunk = np.empty(HOST_CHUNK_BYTES, dtype=np.uint8)
        self.scratch = np.empty(HOST_CHUNK_BYTES, dtype=np.uint8)
        self.skip = np.empty(0, dtype=np.uint8)
        self.staging: dict[torch.device, _Staging] = {}

    def scratch_of(self, nbytes: int) -> Bytes:
        if self.scratch.size < nbytes:
            self.scratch = np.empty(nbytes, dtype=np.uint8)
        return self.scratch[:nbytes]

    def skip_of(self, nbytes: int) -> memoryview:
        if self.skip.size < nbytes:
            self.skip = np.empty(nbytes, dtype=np.uint8)
        return self.skip.data[:nbytes]

    def staging_for(self, device: torch.device) -> _Staging:
        staging = self.staging.get(device)
        if staging is None or staging.nbytes < STAGE_BYTES:
            if staging is not None:
                staging.drain()
            staging = self.staging[device] = _Staging(device, STAGE_BYTES)
        return staging


_worker = _Worker()


class _Sink:
    """Where one storage's chunks go; hands out the buffer each chunk is prepared in."""

    chunk_bytes = HOST_CHUNK_BYTES

    def __init__(self, dest: Destination) -> None:
        self.dest = dest
        self.host: Bytes | None = None
        self.device: torch.device | None = None
        if isinstance(dest, torch.Tensor):
            flat = dest.reshape(-1).view(torch.uint8)
            if dest.device.type == "cpu":
                self.host = flat.numpy()
            else:
                self.device = dest.device
                self.gpu = flat
                self.staging = _worker.staging_for(dest.device)
                self.chunk_bytes = STAGE_BYTES
        self.slot = -1

    def buffer(self, nbytes: int) -> Bytes:
        if self.device is not None:
            self.slot = self.staging.take()
            return self.staging.arrays[self.slot][:nbytes]
        if _worker.chunk.size < nbytes:
            _worker.chunk = np.empty(nbytes, dtype=np.uint8)
        return _worker.chunk[:nbytes]

    def commit(self, buf: Bytes, offset: int) -> None:
        """Write the prepared ``buf`` at byte ``offset`` of the storage."""
        if self.device is not None:
            self.staging.upload(self.slot, buf.size, self.gpu[offset : offset + buf.size])
        elif self.host is not None:
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


def _read_rows(src: SourceFiles, s: RowSource, first: int, out: Bytes) -> None:
    """Rows ``first..first+len(out)`` of ``s`` into the byte array ``out`` ``[n, width]``
    (rows may be strided): one ``preadv`` that scatters the rows and drops other columns."""
    offset = first * s.row_bytes
    if s.cols == (0, s.row_bytes) and out.flags.c_contiguous:
        src.read(s.tensor, offset, [out.reshape(-1).data])
        return
    after_bytes = s.row_bytes - s.cols[1]
    skip = _worker.skip_of(max(s.cols[0], after_bytes))  # both ends may land in the same bytes
    before = skip[: s.cols[0]] if s.cols[0] else None
    after = skip[:after_bytes] if after_bytes else None
    buffers: list[memoryview] = []
    for i in range(out.shape[0]):
        if before is not None:
            buffers.append(before)
        buffers.append(out[i].data)
        if after is not None:
            buffers.append(after)
    src.read(s.tensor, offset, buffers)


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
            _read_rows(src, s, first, rows[:, : s.width])
            checked = rows
        else:
            checked = _worker.scratch_of((hi - lo) * s.width).reshape(hi - lo, s.width)
            _read_rows(src, s, first, checked)
        if has_non_finite(checked, s.dtype):
            raise CorruptFileError(
                "tensor data holds NaN or infinite values", file=s.file, tensor=s.tensor
            )
        if s.code_map is not None:
            s.code_map.apply(checked, rows[:, : s.width])
    if not covered.all():
        buf[~covered] = 0


def _chunks(rows: int, row_bytes: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    step = max(1, chunk_bytes // max(1, row_bytes))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def _fill_rows(src: SourceFiles, fill: RowFill, sink: _Sink, stop: threading.Event) -> str:
    """Fill one storage; returns the xxh3 of its bytes."""
    digest = xxhash.xxh3_64()
    for start, end in _chunks(fill.rows, fill.row_bytes, sink.chunk_bytes):
        if stop.is_set():
            raise _Stopped
        buf = sink.buffer((end - start) * fill.row_bytes)
        _fill_chunk(src, fill, start, buf.reshape(end - start, fill.row_bytes))
        digest.update(buf.data)
        sink.commit(buf, start * fill.row_bytes)
    return digest.hexdigest()


def _fill_small(fill: SmallFill, sink: _Sink) -> str:
    value = fill.make().to(fill.spec.dtype).reshape(fill.spec.storage_shape).contiguous()
    data = value.reshape(-1).view(torch.uint8).numpy()
    buf = sink.buffer(data.size)
    buf[...] = data
    sink.commit(buf, 0)
    return xxhash.xxh3_64_hexdigest(data.data)


def _device_of(dest: Destination) -> torch.device | None:
    if isinstance(dest, torch.Tensor) and dest.device.type == "cuda":
        return dest.device
    return None


def _run_job(
    src: SourceFiles, job: Job, dests: dict[str, Destination], stop: threading.Event
) -> dict[str, str]:
    checksums = {}
    device = _device_of(dests[job.specs[0].name])
    with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
        try:
            for fill in job.fills():
                sink = _Sink(dests[fill.spec.name])
                if isinstance(fill, RowFill):
                    checksums[fill.spec.name] = _fill_rows(src, fill, sink, stop)
                else:
                    checksums[fill.spec.name] = _fill_small(fill, sink)
        finally:
            staging = _worker.staging.get(device) if device is not None else None
            if staging is not None:  # the pinned buffers are reused: their copies must end
                staging.drain()
    return checksums


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
