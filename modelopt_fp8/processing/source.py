"""Checkpoint bytes read straight into the memory that keeps them.

A load copies each tensor once, from the page cache into its destination (an arena slot, or a
pinned staging buffer on the way to a GPU), with ``preadv``: it releases the GIL, so reads run in
parallel threads, and a list of buffers scatters rows into a padded or sliced layout in one
call. Every read goes through :meth:`SourceFiles.read`, the one place that touches descriptors.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from protocol.errors import CorruptFileError, MissingTensorError

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


@dataclass(frozen=True)
class Extent:
    """Where a tensor's data lies: ``nbytes`` bytes of ``file`` from ``offset`` on."""

    file: Path
    offset: int
    nbytes: int


def data_extents(path: Path, fd: int | None = None) -> dict[str, Extent]:
    """Each tensor's byte range in a safetensors file, from its header (already validated when
    the checkpoint was opened), read through ``fd`` when given rather than by name."""
    try:
        if fd is None:
            with path.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
        else:
            (length,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            header = json.loads(os.pread(fd, length, 8))
    except (OSError, struct.error, ValueError) as exc:
        raise CorruptFileError(f"cannot read the header: {exc}", file=str(path)) from exc
    start = 8 + length
    extents = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        extents[name] = Extent(path, start + int(begin), int(end) - int(begin))
    return extents


def read_into(fd: int, offset: int, buffers: Sequence[memoryview]) -> int:
    """Fill ``buffers`` in order with the bytes of ``fd`` from ``offset`` on; returns how many
    bytes were read (less than asked only at the end of the file)."""
    total = 0
    pending = list(buffers)
    first = 0  # pending[first:] is still to fill
    while first < len(pending):
        got = os.preadv(fd, pending[first : first + IOV_MAX], offset + total)
        if got == 0:
            break
        total += got
        while first < len(pending) and got >= pending[first].nbytes:
            got -= pending[first].nbytes
            first += 1
        if got:  # a short read stopped inside this buffer
            pending[first] = pending[first][got:]
    return total


class SourceFiles:
    """A checkpoint's files, each opened once, and where every tensor lies in them."""

    def __init__(self, files: Sequence[Path], opened: dict[str, int] | None = None) -> None:
        """``opened`` (file name -> descriptor, e.g. :meth:`Checkpoint.descriptors`) is read
        through (a duplicate of it) instead of opening the name again, so the bytes read are
        those of the files the checkpoint checked, even if a name is swapped meanwhile."""
        self._extents: dict[str, Extent] = {}
        self._fds: dict[Path, int] = {}
        try:
            for path in files:
                given = (opened or {}).get(path.name)
                fd = os.open(path, os.O_RDONLY) if given is None else os.dup(given)
                self._fds[path] = fd
                self._extents.update(data_extents(path, fd))
        except OSError as exc:
            self.close()
            raise CorruptFileError(f"cannot open: {exc}", file=str(exc.filename)) from exc
        except BaseException:
            self.close()
            raise

    def extent(self, name: str) -> Extent:
        extent = self._extents.get(name)
        if extent is None:
            raise MissingTensorError("tensor not in the checkpoint", tensor=name)
        return extent

    def read(self, name: str, offset: int, buffers: Sequence[memoryview]) -> None:
        """Fill ``buffers`` with tensor ``name``'s bytes from byte ``offset`` of its data on."""
        extent = self.extent(name)
        want = sum(b.nbytes for b in buffers)
        if offset < 0 or offset + want > extent.nbytes:
            raise ValueError(f"{name}: bytes [{offset}, {offset + want}) outside the tensor")
        try:
            got = read_into(self._fds[extent.file], extent.offset + offset, buffers)
        except OSError as exc:
            raise CorruptFileError(
                f"cannot read: {exc}", file=str(extent.file), tensor=name
            ) from exc
        if got != want:
            raise CorruptFileError(
                f"file ends {want - got} bytes early", file=str(extent.file), tensor=name
            )

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> SourceFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
