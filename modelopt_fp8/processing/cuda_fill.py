"""Filling storages that live on a GPU: the raw rows go up, the processing happens there.

The host only reads. Each chunk of a segment's rows goes with one ``preadv`` into one of the
loading thread's two pinned buffers and up with an asynchronous copy on the thread's own
stream, straight to its place in the storage, while the next chunk is read into the other
buffer. What would cost host cores (and the GIL, which byte gathers and reductions in NumPy
hold) is done by the GPU at memory speed, in stream order behind the copies:

* zeroing the padding (CUTLASS pads K and N to 16) and rows no segment covers;
* the NaN/infinity check of every byte read (:func:`.integrity.any_non_finite`), gathered once
  per job: a load with a bad tensor fails as a whole, as on the host;
* requantization: the shard's code map (the same 256-entry table the host applies, so the same
  bytes) gathered per byte.

The manifest's xxh3 is taken over the processed bytes: from the pinned buffers as they are read
when the storage is its sources' rows as they are (most tensors), otherwise from the storage
copied back in chunks once the GPU has processed it (requantized or padded layers); the copies
back run on the other direction of the link.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
import xxhash

from modelopt_fp8.processing.integrity import any_non_finite
from modelopt_fp8.processing.rows import (
    Bytes,
    Destination,
    Fill,
    RowFill,
    RowSource,
    SmallFill,
    Stopped,
    chunk_rows,
    read_rows,
)
from modelopt_fp8.processing.source import SourceFiles
from protocol.errors import CorruptFileError

STAGE_BYTES = 16 << 20  # one pinned buffer (two per loading thread and GPU)
DEVICE_SLICE_BYTES = 64 << 20  # the most bytes checked or mapped at once (bounds temporaries)


class _Staging:
    """A loading thread's stream and two pinned buffers for one GPU: a chunk is read into one
    buffer while the other is on its way."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self.buffers = [
            torch.empty(STAGE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)
        ]
        self.arrays: list[Bytes] = [b.numpy() for b in self.buffers]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def take(self, nbytes: int) -> int:
        """The next buffer (of at least ``nbytes``), once the copy last made from or into it
        is done."""
        if nbytes > self.buffers[0].numel():  # a row wider than the buffers: grow them
            self.drain()
            self.buffers = [
                torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)
            ]
            self.arrays = [b.numpy() for b in self.buffers]
        i = self.turn
        self.turn ^= 1
        self.wait(i)
        return i

    def wait(self, i: int) -> None:
        event = self.events[i]
        if event is not None:
            event.synchronize()
            self.events[i] = None

    def copied(self, i: int) -> None:
        """Mark buffer ``i`` busy until the work queued on the stream so far is done."""
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self.stream)
        self.events[i] = event

    def drain(self) -> None:
        self.stream.synchronize()
        self.events = [None, None]


class _PerThread(threading.local):
    def __init__(self) -> None:
        self.staging: dict[torch.device, _Staging] = {}


_local = _PerThread()


def _staging_for(device: torch.device) -> _Staging:
    staging = _local.staging.get(device)
    if staging is None:
        staging = _local.staging[device] = _Staging(device)
    return staging


def _row_slices(rows: int, row_bytes: int) -> list[tuple[int, int]]:
    return chunk_rows(rows, row_bytes, DEVICE_SLICE_BYTES)


class _Job:
    """One job's fills on one GPU, on the calling loading thread."""

    def __init__(self, src: SourceFiles, staging: _Staging, stop: threading.Event) -> None:
        self.src = src
        self.staging = staging
        self.stop = stop
        self.checks: list[tuple[torch.Tensor, RowSource]] = []
        self.luts: dict[int, torch.Tensor] = {}

    def small(self, fill: SmallFill, flat: torch.Tensor) -> str:
        data = fill.host_bytes()
        i = self.staging.take(data.size)
        self.staging.arrays[i][: data.size] = data
        flat.copy_(self.staging.buffers[i][: data.size], non_blocking=True)
        self.staging.copied(i)
        return xxhash.xxh3_64_hexdigest(data.data)

    def rows(self, fill: RowFill, flat: torch.Tensor) -> str | None:
        """Upload and process one storage; returns its xxh3 when taken while reading, None
        when it must be taken from the processed storage (:meth:`hash_back`)."""
        table = flat.view(fill.rows, fill.row_bytes)
        digest = xxhash.xxh3_64() if fill.as_stored else None
        if digest is None:
            table.zero_()
        for seg in fill.segments:
            s = seg.source
            region = table[seg.dest_row : seg.dest_row + seg.rows, : s.width]
            for lo, hi in chunk_rows(seg.rows, s.width, STAGE_BYTES):
                if self.stop.is_set():
                    raise Stopped
                nbytes = (hi - lo) * s.width
                i = self.staging.take(nbytes)
                read_rows(
                    self.src,
                    s,
                    s.first_row + lo,
                    self.staging.arrays[i][:nbytes].reshape(-1, s.width),
                )
                if digest is not None:
                    digest.update(self.staging.arrays[i][:nbytes].data)
                region[lo:hi].copy_(
                    self.staging.buffers[i][:nbytes].view(hi - lo, s.width), non_blocking=True
                )
                self.staging.copied(i)
            self._check(region, s)
            if s.code_map is not None:
                self._map(region, s)
        return None if digest is None else digest.hexdigest()

    def _check(self, region: torch.Tensor, s: RowSource) -> None:
        for lo, hi in _row_slices(region.shape[0], s.width):
            found = any_non_finite(region[lo:hi], s.dtype)
            if found is not None:
                self.checks.append((found, s))

    def _map(self, region: torch.Tensor, s: RowSource) -> None:
        assert s.code_map is not None
        key = id(s.code_map)
        lut = self.luts.get(key)
        if lut is None:
            lut = self.luts[key] = torch.from_numpy(s.code_map.table).to(region.device)
        for lo, hi in _row_slices(region.shape[0], s.width):
            part = region[lo:hi]
            part.copy_(lut[part.to(torch.int32)])

    def hash_back(self, flat: torch.Tensor) -> str:
        """The xxh3 of a processed storage, copied back in chunks (one on its way while the
        one before is hashed)."""
        digest = xxhash.xxh3_64()
        pending: tuple[int, int] | None = None
        total = flat.numel()
        for start in range(0, total, STAGE_BYTES):
            nbytes = min(STAGE_BYTES, total - start)
            i = self.staging.take(nbytes)
            self.staging.buffers[i][:nbytes].copy_(flat[start : start + nbytes], non_blocking=True)
            self.staging.copied(i)
            if pending is not None:
                self._hash_pending(digest, pending)
            pending = (i, nbytes)
        if pending is not None:
            self._hash_pending(digest, pending)
        return digest.hexdigest()

    def _hash_pending(self, digest: xxhash.xxh3_64, pending: tuple[int, int]) -> None:
        i, nbytes = pending
        self.staging.wait(i)
        digest.update(self.staging.arrays[i][:nbytes].data)

    def raise_non_finite(self) -> None:
        """Once the stream is done: refuse the job if any checked region held a NaN or an
        infinity (one transfer for all the job's checks)."""
        if not self.checks:
            return
        found = torch.stack([flag for flag, _ in self.checks]).cpu().numpy()
        for hit, (_, s) in zip(found.tolist(), self.checks, strict=True):
            if hit:
                raise CorruptFileError(
                    "tensor data holds NaN or infinite values", file=s.file, tensor=s.tensor
                )


def fill_on_gpu(
    src: SourceFiles,
    fills: Sequence[Fill],
    dests: dict[str, Destination],
    device: torch.device,
    stop: threading.Event,
) -> dict[str, str]:
    """Fill one job's storages on ``device``; returns their xxh3 checksums. Returns (or
    raises) only once the GPU is done with the thread's pinned buffers."""
    staging = _staging_for(device)
    job = _Job(src, staging, stop)
    checksums: dict[str, str] = {}
    hashed_back: list[tuple[str, torch.Tensor]] = []
    with torch.cuda.device(device), torch.cuda.stream(staging.stream):
        try:
            for fill in fills:
                dest = dests[fill.spec.name]
                assert isinstance(dest, torch.Tensor)
                flat = dest.reshape(-1).view(torch.uint8)
                if isinstance(fill, SmallFill):
                    checksums[fill.spec.name] = job.small(fill, flat)
                    continue
                checksum = job.rows(fill, flat)
                if checksum is None:
                    hashed_back.append((fill.spec.name, flat))
                else:
                    checksums[fill.spec.name] = checksum
            for name, flat in hashed_back:
                checksums[name] = job.hash_back(flat)
            staging.drain()
            job.raise_non_finite()
        finally:
            staging.drain()  # the pinned buffers are reused: their copies must end
    return checksums
