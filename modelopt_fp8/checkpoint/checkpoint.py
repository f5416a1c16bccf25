"""A ModelOpt FP8 checkpoint on disk: configs, tensor index, fingerprint and reads.

Opening validates everything that can be validated without reading weight data: the configs,
the architecture, and every safetensors header. Weight shapes, dtypes and scale values are checked
by the processing plan (``modelopt_fp8.processing.plan``) before any memory is allocated.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from modelopt_fp8.checkpoint.architecture import ModelDims, read_dims
from modelopt_fp8.checkpoint.fingerprint import checkpoint_digests, full_digest, identity_files
from modelopt_fp8.checkpoint.quant_config import MODEL_CONFIG, QuantConfig, read_quant_config
from modelopt_fp8.checkpoint.safetensors_files import (
    TensorInfo,
    TensorReader,
    index_tensors,
    unreadable,
    weight_files,
)
from protocol.errors import CheckpointNotFoundError, InvalidConfigError
from protocol.schemas.manifest import CheckpointDigests


@dataclass
class Checkpoint:
    """An opened checkpoint; use as a context manager or call :meth:`close`."""

    path: Path
    config: dict[str, Any]
    dims: ModelDims
    quant: QuantConfig
    tensors: dict[str, TensorInfo]
    files: list[Path]
    _reader: TensorReader = field(repr=False)
    _headers: dict[str, bytes] = field(repr=False)

    @classmethod
    def open(cls, path: str | Path) -> Checkpoint:
        directory = Path(path)
        config_path = directory / MODEL_CONFIG
        if not directory.is_dir():
            raise CheckpointNotFoundError(
                "checkpoint directory does not exist", file=str(directory)
            )
        if not config_path.is_file():
            raise CheckpointNotFoundError("no config.json in the directory", file=str(config_path))
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise unreadable(exc, config_path) or InvalidConfigError(
                f"cannot parse config.json: {exc}", file=str(config_path)
            ) from exc
        if not isinstance(config, dict):
            raise InvalidConfigError("config.json is not a JSON object", file=str(config_path))
        quant = read_quant_config(directory, config)
        dims = read_dims(config, str(config_path))
        files, weight_map = weight_files(directory)
        tensors, headers = index_tensors(files, weight_map)
        return cls(
            path=directory,
            config=config,
            dims=dims,
            quant=quant,
            tensors=tensors,
            files=files,
            _reader=TensorReader(tensors),
            _headers=headers,
        )

    @functools.cached_property
    def digests(self) -> CheckpointDigests:
        """Every identity tier but ``full`` (see :meth:`full_digest`), computed on first use."""
        return checkpoint_digests(self.path, self.files, self._headers)

    @property
    def fingerprint(self) -> str:
        """The default (sampled) identity tier's digest."""
        return self.digests.sampled

    def full_digest(self, between: Callable[[], None] | None = None) -> str:
        """The ``full`` identity tier: a hash of every byte the checkpoint is read from."""
        return full_digest(identity_files(self.path, self.files), between)

    def read(
        self,
        name: str,
        rows: tuple[int, int] | None = None,
        cols: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        return self._reader.read(name, rows=rows, cols=cols)

    def close(self) -> None:
        self._reader.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
