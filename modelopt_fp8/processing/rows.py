"""What a load writes, described as rows, and how those rows are read from the checkpoint.

A processed tensor is seen as ``[rows, row_bytes]``: a list of row segments copied from
checkpoint tensors (sliced by columns for tensor parallelism, mapped through a code table when
requantized), with zeros wherever no segment lies (CUTLASS padding). Small computed tensors
(fused scales) are made on the host. The host (:mod:`.fill`) and the GPU (:mod:`.cuda_fill`)
carry out the same descriptions.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from modelopt_fp8.processing.fp8 import CodeMap
from modelopt_fp8.processing.source import SourceFiles
from modelopt_fp8.processing.tensor_spec import TensorSpec

Bytes = npt.NDArray[np.uint8]
OnProgress = Callable[[int, int], None]  # (bytes written, tensors written) since the last call


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

    @property
    def as_stored(self) -> bool:
        """Whether the storage is its sources' rows as they are, one after another: its bytes
        are then the bytes read, in order (no padding, no code map, no gap)."""
        row = 0
        for seg in self.segments:
            s = seg.source
            if seg.dest_row != row or s.code_map is not None or s.width != self.row_bytes:
                return False
            row += seg.rows
        return row == self.rows


@dataclass(frozen=True)
class SmallFill:
    """A small tensor computed on the host (fused scales)."""

    spec: TensorSpec
    make: Callable[[], torch.Tensor]

    def host_bytes(self) -> Bytes:
        """The tensor's storage bytes, on the host."""
        value = self.make().to(self.spec.dtype).reshape(self.spec.storage_shape).contiguous()
        return value.reshape(-1).view(torch.uint8).numpy()


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


class Stopped(Exception):
    """Another part of the load failed or was cancelled: stop between chunks."""


def storage_rows(spec: TensorSpec) -> tuple[int, int]:
    """A storage as rows: ``(rows, bytes per row)`` (a 0-dim tensor is one row)."""
    shape = spec.storage_shape
    if not shape:
        return 1, spec.dtype.itemsize
    row_bytes = spec.dtype.itemsize
    for d in shape[1:]:
        row_bytes *= d
    return shape[0], row_bytes


def chunk_rows(rows: int, row_bytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """``[start, end)`` row ranges of at most ``chunk_bytes`` (at least one row each)."""
    step = max(1, chunk_bytes // max(1, row_bytes))
    return [(start, min(rows, start + step)) for start in range(0, rows, step)]


class _SkipBuffer(threading.local):
    """Per thread: where a sliced read drops the columns it does not keep."""

    def __init__(self) -> None:
        self.data = np.empty(0, dtype=np.uint8)

    def of(self, nbytes: int) -> memoryview:
        if self.data.size < nbytes:
            self.data = np.empty(nbytes, dtype=np.uint8)
        return self.data.data[:nbytes]


_skip = _SkipBuffer()


def read_rows(src: SourceFiles, s: RowSource, first: int, out: Bytes) -> None:
    """Rows ``first..first+len(out)`` of ``s`` into the byte array ``out`` ``[n, width]``
    (rows may be strided): one ``preadv`` that scatters the rows and drops other columns."""
    offset = first * s.row_bytes
    if s.cols == (0, s.row_bytes) and out.flags.c_contiguous:
        src.read(s.tensor, offset, [out.reshape(-1).data])
        return
    after_bytes = s.row_bytes - s.cols[1]
    skip = _skip.of(max(s.cols[0], after_bytes))  # both ends may land in the same bytes
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
