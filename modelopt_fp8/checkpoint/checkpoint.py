"""A ModelOpt FP8 checkpoint on disk: configs, tensor index, fingerprint and reads.

Opening validates everything that can be validated without reading weight data: the configs,
the architecture, every safetensors header, and that the config's sizes agree with the tensors
the headers list. Weight shapes, dtypes and scale values are checked by the processing plan
(``modelopt_fp8.processing.plan``) before any memory is allocated.

Every file is opened once, by descriptor (see :mod:`modelopt_fp8.checkpoint.opened`), under a
:class:`PathPolicy`; all reads go through those descriptors, so what was checked is what is read.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from modelopt_fp8.checkpoint.architecture import (
    ModelDims,
    check_dims,
    check_header_room,
    check_raw_headers,
    read_dims,
)
from modelopt_fp8.checkpoint.fingerprint import checkpoint_digests, full_digest, identity_files
from modelopt_fp8.checkpoint.opened import (
    CheckpointDir,
    OpenedFile,
    PathPolicy,
    ReadFile,
    parse_json_object,
)
from modelopt_fp8.checkpoint.quant_config import (
    HF_QUANT_CONFIG,
    MODEL_CONFIG,
    QuantConfig,
    quant_config_from,
)
from modelopt_fp8.checkpoint.safetensors_files import (
    Span,
    TensorInfo,
    TensorReader,
    index_tensors,
    weight_files,
)
from protocol.errors import CheckpointNotFoundError
from protocol.schemas.manifest import CheckpointDigests

# Headers this small cost under a millisecond to parse: they are parsed as they are, so what is
# wrong with them is said precisely (a corrupt header as corrupt). Larger ones are first held
# against what the config promises, by their lengths and then their bytes.
PARSED_AS_THEY_ARE = 64 * 1024


def _read_json(file: OpenedFile) -> tuple[bytes, dict[str, Any]]:
    try:
        data = file.read_all()
    finally:
        file.close()
    return data, parse_json_object(data, file)


@dataclass
class Checkpoint(contextlib.AbstractContextManager["Checkpoint"]):
    """An opened checkpoint; use as a context manager or call :meth:`close`.

    Reads: :meth:`read` (a fresh tensor, optionally rows/columns of it) and :meth:`read_into`
    (straight into caller-owned contiguous memory). Both are ``os.pread`` calls on descriptors
    opened once: they release the GIL and may run from several threads at once.
    """

    path: Path
    config: dict[str, Any]
    dims: ModelDims
    quant: QuantConfig
    tensors: dict[str, TensorInfo]
    files: list[Path]
    _reader: TensorReader = field(repr=False)
    _headers: dict[str, bytes] = field(repr=False)
    _read_files: dict[str, ReadFile] = field(repr=False)  # configs and index, as read

    @classmethod
    def open(
        cls,
        path: str | Path,
        policy: PathPolicy | None = None,
        claim_headers: Callable[[int], None] | None = None,
    ) -> Checkpoint:
        """Open and validate; ``policy`` limits where files may be read from (default: any);
        ``claim_headers`` is told how many bytes of safetensors headers will be parsed, before
        any is (it may wait for room, or refuse)."""
        directory = CheckpointDir.open(path, policy)
        files: list[OpenedFile] = []
        try:
            config_file = directory.require_file(
                MODEL_CONFIG, CheckpointNotFoundError, "no config.json in the directory"
            )
            config_bytes, config = _read_json(config_file)
            configs = {MODEL_CONFIG: config_bytes}
            hf_data = None
            hf_file = directory.open_file(HF_QUANT_CONFIG)
            if hf_file is not None:
                configs[HF_QUANT_CONFIG], hf_data = _read_json(hf_file)
            source = str(directory.path / MODEL_CONFIG)
            quant = quant_config_from(directory.path, config, hf_data)
            dims = read_dims(config, source)
            files, weight_map = weight_files(directory)

            def before_reading(header_bytes: int) -> None:
                if header_bytes > PARSED_AS_THEY_ARE:
                    check_header_room(dims, header_bytes, source)
                if claim_headers is not None:
                    claim_headers(header_bytes)

            def before_parsing(raws: list[bytes]) -> None:
                if sum(map(len, raws)) > PARSED_AS_THEY_ARE:
                    check_raw_headers(dims, raws, source)

            tensors, headers = index_tensors(files, weight_map, before_reading, before_parsing)
            check_dims(dims, {name: info.shape for name, info in tensors.items()}, source)
            read_files = directory.read_files()
        except BaseException:
            for f in files:
                f.close()
            raise
        finally:
            directory.close()
        return cls(
            path=directory.path,
            config=config,
            dims=dims,
            quant=quant,
            tensors=tensors,
            files=[f.path for f in files],
            _reader=TensorReader(tensors, files),
            _headers=headers,
            _read_files=read_files,
        )

    @functools.cached_property
    def digests(self) -> CheckpointDigests:
        """Every identity tier but ``full`` (see :meth:`full_digest`), computed on first use."""
        return checkpoint_digests(
            self.path, self.files, self._headers, self.descriptors(), self._read_files
        )

    def descriptors(self) -> dict[str, int]:
        """Weight file name -> the descriptor it was opened and checked through (valid until
        :meth:`close`): readers use these, never the names again."""
        return self._reader.descriptors()

    @property
    def fingerprint(self) -> str:
        """The default (sampled) identity tier's digest."""
        return self.digests.sampled

    def full_digest(
        self, between: Callable[[], None] | None = None, executor: Executor | None = None
    ) -> str:
        """The ``full`` identity tier: a hash of every byte the checkpoint is read from (its
        weight files through the descriptors they were checked through, its configs as read)."""
        return full_digest(
            identity_files(self.path, self.files, self._read_files),
            between,
            self.descriptors(),
            executor,
            self._read_files,
        )

    def read(self, name: str, rows: Span | None = None, cols: Span | None = None) -> torch.Tensor:
        return self._reader.read(name, rows=rows, cols=cols)

    def read_into(self, name: str, out: torch.Tensor, rows: Span | None = None) -> torch.Tensor:
        return self._reader.read_into(name, out, rows=rows)

    def close(self) -> None:
        self._reader.close()

    def __exit__(self, *exc: object) -> None:
        self.close()
