"""Safetensors files of a checkpoint: which files, which tensors, their raw headers, and reads.

Every file is opened once (:mod:`modelopt_fp8.checkpoint.opened`) and read through its descriptor.
Headers are validated here with the ``safetensors`` format's own rules (bounded header length,
a JSON object of ``dtype``/``shape``/``data_offsets`` entries plus an optional string-to-string
``__metadata__``, offsets that tile the data exactly with every tensor's size matching its shape),
so a hostile file is refused before anything trusts it; errors are
:class:`~protocol.errors.CorruptFileError` naming the file. The raw header bytes are kept for the
checkpoint fingerprint.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

import torch

from modelopt_fp8.checkpoint.header_json import HeaderJsonError, header_entries
from modelopt_fp8.checkpoint.opened import (
    MAX_WEIGHT_FILES,
    CheckpointDir,
    OpenedFile,
    parse_json_object,
)
from protocol.errors import CorruptFileError, InvalidConfigError, MissingTensorError

Span: TypeAlias = tuple[int, int]
"""A half-open index range ``(start, stop)`` of a tensor's rows or columns."""

INDEX_FILE = "model.safetensors.index.json"
# Far larger than any real checkpoint (a 70B model's headers are ~100 KB in all, a dense model
# lists a few thousand tensors in a few dozen files): they bound what lying headers can cost to
# open, parse and hold, in all files together.
MAX_HEADER_BYTES = 16 * 1024 * 1024
MAX_TENSORS = 65_536

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


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where a tensor lives and what its header says (slotted: a checkpoint may list tens of
    thousands, and each costs a fraction of a plain object)."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int = 0  # of its first byte in the file

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def header_length(file: OpenedFile) -> int:
    """The length of the file's JSON header, as its first 8 bytes say, bounded in size."""
    if file.size < 8:
        raise CorruptFileError("file shorter than the 8-byte header length", file=str(file.path))
    (length,) = struct.unpack("<Q", file.pread(0, 8))
    if length > MAX_HEADER_BYTES or length > file.size - 8:
        raise CorruptFileError(
            f"header length {length} exceeds the file ({file.size} bytes) or the "
            f"{MAX_HEADER_BYTES}-byte limit",
            file=str(file.path),
        )
    return int(length)


def read_header(file: OpenedFile, length: int | None = None) -> bytes:
    """The JSON header bytes exactly as stored (for fingerprints), bounded in size."""
    return file.pread(8, header_length(file) if length is None else length)


def _shape(raw: Any) -> tuple[int, ...] | None:
    if not isinstance(raw, list):
        return None
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in raw):
        return None
    return tuple(raw)


def parse_header(
    file: OpenedFile, raw: bytes, max_tensors: int = MAX_TENSORS
) -> dict[str, TensorInfo]:
    """Every tensor the header describes (at most ``max_tensors``), validated against the
    file's size. The header is parsed an entry at a time (:mod:`header_json`), so a huge one
    neither holds the GIL nor memory past the bound."""
    where = str(file.path)
    data_start = 8 + len(raw)
    infos: dict[str, TensorInfo] = {}
    seen_metadata = False
    refused = None
    try:
        for name, entry in header_entries(raw, max_tensors + 1):  # + __metadata__
            if name == "__metadata__" and not seen_metadata:
                seen_metadata = True
                _check_metadata(entry, where)
                continue
            if name in infos or name == "__metadata__":
                raise CorruptFileError("header names this tensor twice", file=where, tensor=name)
            infos[name] = _entry_info(file, name, entry, data_start)
            if len(infos) > max_tensors:
                raise HeaderJsonError(f"header lists more than {max_tensors} tensors")
    except HeaderJsonError as exc:
        refused = str(exc)
    if refused is not None:
        # Raised outside the handler: the error a model keeps must not chain to a traceback
        # holding everything parsed so far.
        del infos
        raise CorruptFileError(refused, file=where)
    _check_tiling(infos, data_start, file)
    return infos


def _check_metadata(metadata: Any, where: str) -> None:
    if not (
        isinstance(metadata, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise CorruptFileError("__metadata__ must map strings to strings", file=where)


def _entry_info(file: OpenedFile, name: str, entry: Any, data_start: int) -> TensorInfo:
    """One header entry as a :class:`TensorInfo`, its size checked against its offsets."""
    where = str(file.path)
    if not isinstance(entry, dict):
        raise CorruptFileError("header entry is not an object", file=where, tensor=name)
    dtype = SAFETENSORS_DTYPES.get(entry.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise CorruptFileError(
            f"unsupported safetensors dtype {str(entry.get('dtype'))[:32]!r}",
            file=where,
            tensor=name,
        )
    shape = _shape(entry.get("shape"))
    offsets = _shape(entry.get("data_offsets"))
    if shape is None or offsets is None or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise CorruptFileError(
            "shape or data_offsets are not lists of non-negative integers (data offsets "
            "must be [start, end])",
            file=where,
            tensor=name,
        )
    info = TensorInfo(name, file.path, dtype, shape, data_start + offsets[0])
    if info.nbytes != offsets[1] - offsets[0]:
        raise CorruptFileError(
            f"shape {list(shape)} of {dtype} needs {info.nbytes} bytes but its data "
            f"offsets span {offsets[1] - offsets[0]}",
            file=where,
            tensor=name,
        )
    return info


def _check_tiling(infos: dict[str, TensorInfo], data_start: int, file: OpenedFile) -> None:
    """The tensors' data must cover the file after the header exactly, without overlap."""
    where = str(file.path)
    end = data_start
    for info in sorted(infos.values(), key=_by_offset_then_size):
        if info.offset != end:
            raise CorruptFileError(
                f"data offsets do not tile the data: {info.name} starts at "
                f"{info.offset - data_start}, expected {end - data_start}",
                file=where,
                tensor=info.name,
            )
        end += info.nbytes
    if end != file.size:
        raise CorruptFileError(
            f"data offsets cover {end - data_start} bytes but the file holds "
            f"{file.size - data_start} after the header (truncated or padded)",
            file=where,
        )


def _by_offset_then_size(info: TensorInfo) -> tuple[int, int]:
    return info.offset, info.nbytes


def weight_files(directory: CheckpointDir) -> tuple[list[OpenedFile], dict[str, str] | None]:
    """The checkpoint's safetensors files, opened, and, when sharded, the index's weight map."""
    index_file = directory.open_file(INDEX_FILE)
    names: list[str]
    weight_map: dict[str, str] | None = None
    if index_file is not None:
        try:
            index = parse_json_object(index_file.read_all(), index_file)
        finally:
            index_file.close()
        raw_map = index.get("weight_map")
        if not isinstance(raw_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in raw_map.items()
        ):
            raise InvalidConfigError(
                f"bad {INDEX_FILE}: weight_map must map tensor names to file names",
                file=str(index_file.path),
            )
        weight_map = raw_map
        names = sorted(set(weight_map.values()))
        if len(names) > MAX_WEIGHT_FILES:
            raise InvalidConfigError(
                f"{INDEX_FILE} names {len(names)} files (at most {MAX_WEIGHT_FILES})",
                file=str(index_file.path),
            )
        for name in names:
            if not name or "/" in name or "\0" in name or name in (".", ".."):
                raise InvalidConfigError(
                    f"{INDEX_FILE} names a file outside the checkpoint: {name[:256]!r}",
                    file=str(index_file.path),
                )
    else:
        names = directory.names(".safetensors")
        if not names:
            raise MissingTensorError(
                "no .safetensors files in the checkpoint", file=str(directory.path)
            )
    files: list[OpenedFile] = []
    try:
        for name in names:
            opened = directory.open_file(name)
            if opened is None:
                raise MissingTensorError(
                    f"shard {name} listed in {INDEX_FILE} does not exist",
                    file=str(directory.path / name),
                )
            files.append(opened)
    except BaseException:
        for f in files:
            f.close()
        raise
    return files, weight_map


def index_tensors(
    files: list[OpenedFile],
    weight_map: dict[str, str] | None,
    claim: Callable[[int], None] | None = None,
    before_parse: Callable[[list[bytes]], None] | None = None,
) -> tuple[dict[str, TensorInfo], dict[str, bytes]]:
    """Every tensor across the files (validated), and each file's raw header. The headers'
    lengths are read first and bounded together; ``claim`` is told their sum before a byte of
    them is read (what parsing them will cost grows with it), and ``before_parse`` sees them
    raw before an object is built per tensor (it may refuse them)."""
    lengths = [header_length(file) for file in files]
    if sum(lengths) > MAX_HEADER_BYTES:
        raise CorruptFileError(
            f"the headers of the {len(files)} files hold {sum(lengths)} bytes in all (at most "
            f"{MAX_HEADER_BYTES})",
            file=str(files[0].path.parent),
        )
    if claim is not None:
        claim(sum(lengths))
    raws = [read_header(file, length) for file, length in zip(files, lengths, strict=True)]
    if before_parse is not None:
        before_parse(raws)
    tensors: dict[str, TensorInfo] = {}
    headers: dict[str, bytes] = {}
    for file, raw in zip(files, raws, strict=True):
        infos = parse_header(file, raw, MAX_TENSORS - len(tensors))
        headers[file.name] = raw
        for name, info in infos.items():
            if name in tensors:
                raise CorruptFileError(
                    f"tensor stored twice (also in {tensors[name].file.name})",
                    file=str(file.path),
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


def _byte_view(tensor: torch.Tensor) -> memoryview:
    return tensor.reshape(-1).view(torch.uint8).numpy().data


class TensorReader:
    """Reads tensors (or row ranges of them) with ``os.pread`` on the opened files: one copy,
    from the page cache into the destination, with the GIL released (threads may read in
    parallel). A file truncated while open gives :class:`CorruptFileError`, never a SIGBUS."""

    def __init__(self, tensors: dict[str, TensorInfo], files: list[OpenedFile]) -> None:
        self._tensors = tensors
        self._files = {f.path: f for f in files}

    def descriptors(self) -> dict[str, int]:
        """File name -> the descriptor it is read through (valid until :meth:`close`)."""
        return {f.name: f.fd for f in self._files.values()}

    def _locate(
        self, name: str, rows: Span | None
    ) -> tuple[TensorInfo, OpenedFile, int, tuple[int, ...]]:
        """The tensor's file, the offset of ``rows`` and the shape read."""
        info = self._tensors.get(name)
        if info is None:
            raise MissingTensorError("tensor not in the checkpoint", tensor=name)
        file = self._files.get(info.file)
        if file is None or file.fd < 0:
            raise CorruptFileError("checkpoint file is closed", file=str(info.file), tensor=name)
        if rows is None or not info.shape:
            return info, file, info.offset, info.shape
        n = info.shape[0]
        start, stop = max(0, min(rows[0], n)), max(0, min(rows[1], n))
        stop = max(start, stop)
        row_bytes = info.nbytes // n if n else 0
        return info, file, info.offset + start * row_bytes, (stop - start, *info.shape[1:])

    def read(self, name: str, rows: Span | None = None, cols: Span | None = None) -> torch.Tensor:
        """The tensor, optionally narrowed to ``rows``/``cols`` (half-open ranges). Rows are
        read alone (they are contiguous); columns are a view of the rows read."""
        info, file, offset, shape = self._locate(name, rows)
        tensor = torch.empty(shape, dtype=info.dtype)
        if tensor.numel():
            file.readinto(offset, _byte_view(tensor))
        if cols is not None:
            tensor = tensor[:, cols[0] : cols[1]]
        return tensor

    def read_into(self, name: str, out: torch.Tensor, rows: Span | None = None) -> torch.Tensor:
        """Read the tensor (or ``rows`` of it) straight into ``out``, a contiguous CPU tensor
        of the same number of bytes (no intermediate buffer)."""
        info, file, offset, shape = self._locate(name, rows)
        nbytes = info.dtype.itemsize
        for d in shape:
            nbytes *= d
        if not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError("read_into needs a contiguous CPU tensor")
        if out.numel() * out.element_size() != nbytes:
            raise ValueError(f"{name}: destination holds {out.nbytes} bytes, source {nbytes}")
        if nbytes:
            file.readinto(offset, _byte_view(out))
        return out

    def close(self) -> None:
        for file in self._files.values():
            file.close()
