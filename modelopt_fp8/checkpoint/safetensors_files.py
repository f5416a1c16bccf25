"""Safetensors files of a checkpoint: which files, which tensors, and their raw headers.

Validation is the ``safetensors`` library's own (it refuses truncated files, headers whose
offsets do not tile the data, oversized headers and bad JSON on open); this module turns its
errors into :class:`~protocol.errors.CorruptFileError` naming the file, and keeps the raw header
bytes for the checkpoint fingerprint.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from protocol.errors import (
    CheckpointError,
    CorruptFileError,
    InvalidConfigError,
    MissingTensorError,
    PermissionDeniedError,
)

INDEX_FILE = "model.safetensors.index.json"
# Larger than any real header (a 70B model's is ~100 KB); bounds what a lying length can cost.
MAX_HEADER_BYTES = 64 * 1024 * 1024

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lives and what its header says."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def unreadable(exc: BaseException, path: Path) -> PermissionDeniedError | None:
    """A permission error, however the failing library reported it (safetensors says "No such
    file" for a file it may not open): asks the OS whether this process may read ``path``."""
    if isinstance(exc, PermissionError) or (path.exists() and not os.access(path, os.R_OK)):
        return PermissionDeniedError(
            f"the daemon (uid {os.getuid()}) may not read this file", file=str(path)
        )
    return None


def file_error(exc: BaseException, path: Path, tensor: str | None = None) -> CheckpointError:
    """The typed error for a safetensors file that failed to open or read."""
    return unreadable(exc, path) or CorruptFileError(str(exc), file=str(path), tensor=tensor)


def read_raw_header(path: Path) -> bytes:
    """The JSON header bytes exactly as stored (for fingerprints), bounded in size."""
    try:
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) != 8:
                raise CorruptFileError("file shorter than the 8-byte header length", file=str(path))
            (length,) = struct.unpack("<Q", prefix)
            size = path.stat().st_size
            if length > MAX_HEADER_BYTES or length > size - 8:
                raise CorruptFileError(
                    f"header length {length} exceeds the file ({size} bytes) or the "
                    f"{MAX_HEADER_BYTES}-byte limit",
                    file=str(path),
                )
            raw = f.read(length)
    except OSError as exc:
        raise unreadable(exc, path) or CorruptFileError(
            f"cannot read: {exc}", file=str(path)
        ) from exc
    return raw


def weight_files(directory: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The checkpoint's safetensors files and, when sharded, the index's weight map."""
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
            ):
                raise TypeError("weight_map must map tensor names to file names")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise unreadable(exc, index_path) or InvalidConfigError(
                f"bad {INDEX_FILE}: {exc}", file=str(index_path)
            ) from exc
        files = []
        for name in sorted(set(weight_map.values())):
            path = (directory / name).resolve()
            if path.parent != directory.resolve():
                raise InvalidConfigError(
                    f"{INDEX_FILE} names a file outside the checkpoint: {name!r}",
                    file=str(index_path),
                )
            if not path.is_file():
                raise MissingTensorError(
                    f"shard {name} listed in {INDEX_FILE} does not exist", file=str(path)
                )
            files.append(directory / name)
        return files, weight_map
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise MissingTensorError("no .safetensors files in the checkpoint", file=str(directory))
    return files, None


def _index_one(path: Path) -> tuple[bytes, dict[str, TensorInfo]]:
    try:
        with safe_open(str(path), framework="pt") as f:  # validates header and offsets
            names = list(f.keys())
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise file_error(exc, path) from exc
    raw = read_raw_header(path)
    header: dict[str, Any] = json.loads(raw)
    infos: dict[str, TensorInfo] = {}
    for name in names:
        entry = header[name]
        dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise CorruptFileError(
                f"unsupported safetensors dtype {entry['dtype']}", file=str(path), tensor=name
            )
        infos[name] = TensorInfo(name, path, dtype, tuple(int(d) for d in entry["shape"]))
    return raw, infos


def index_tensors(
    files: list[Path], weight_map: dict[str, str] | None
) -> tuple[dict[str, TensorInfo], dict[str, bytes]]:
    """Every tensor across the files (validated), and each file's raw header."""
    tensors: dict[str, TensorInfo] = {}
    headers: dict[str, bytes] = {}
    for path in files:
        raw, infos = _index_one(path)
        headers[path.name] = raw
        for name, info in infos.items():
            if name in tensors:
                raise CorruptFileError(
                    f"tensor stored twice (also in {tensors[name].file.name})",
                    file=str(path),
                    tensor=name,
                )
            tensors[name] = info
    if weight_map is not None:
        for name, file_name in weight_map.items():
            placed = tensors.get(name)
            if placed is None or placed.file.name != file_name:
                raise MissingTensorError(
                    f"the index places this tensor in {file_name} but that file does not hold it",
                    file=file_name,
                    tensor=name,
                )
    return tensors, headers


class TensorReader:
    """Reads tensors (or row/column ranges of them) through open safetensors handles."""

    def __init__(self, tensors: dict[str, TensorInfo]) -> None:
        self._tensors = tensors
        self._handles: dict[Path, Any] = {}

    def _handle(self, path: Path) -> Any:
        handle = self._handles.get(path)
        if handle is None:
            try:
                handle = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as exc:
                raise file_error(exc, path) from exc
            self._handles[path] = handle
        return handle

    def read(
        self,
        name: str,
        rows: tuple[int, int] | None = None,
        cols: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """The tensor, optionally narrowed to ``rows``/``cols`` (half-open ranges)."""
        info = self._tensors.get(name)
        if info is None:
            raise MissingTensorError("tensor not in the checkpoint", tensor=name)
        try:
            # get_tensor maps the file without copying; narrowing keeps it a view, so the one
            # copy is the caller's, straight from the page cache into its destination.
            tensor: torch.Tensor = self._handle(info.file).get_tensor(name)
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise file_error(exc, info.file, name) from exc
        if rows is not None:
            tensor = tensor[rows[0] : rows[1]]
        if cols is not None:
            tensor = tensor[:, cols[0] : cols[1]]
        return tensor

    def close(self) -> None:
        self._handles.clear()
