"""Every look a plan takes at a checkpoint, checked as it is taken: the tensor exists, its dtype
and shape agree with config.json, a scale is finite and positive.

The reads are recorded too: which tensors a layer claimed (the rest are carried as stored) and
every scale's value (tiny, and needed again to process), so a checkpoint is judged once.
"""

from __future__ import annotations

import torch

from modelopt_fp8.checkpoint import Checkpoint
from modelopt_fp8.checkpoint.safetensors_files import TensorInfo
from protocol.errors import (
    InvalidScaleError,
    MissingTensorError,
    TensorDtypeError,
    TensorShapeError,
)


class CheckedReads:
    """The checkpoint as planning sees it: headers and scales, each checked on first use."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        self.scales: dict[str, torch.Tensor] = {}
        self.consumed: set[str] = set()

    def info(self, name: str) -> TensorInfo:
        """The header of ``name``, which the model's config requires; marks it consumed."""
        info = self.ckpt.tensors.get(name)
        if info is None:
            raise MissingTensorError(
                "tensor required by the model config is missing",
                tensor=name,
                file=str(self.ckpt.path),
            )
        self.consumed.add(name)
        return info

    @staticmethod
    def expect_dtype(info: TensorInfo, allowed: tuple[torch.dtype, ...]) -> None:
        if info.dtype not in allowed:
            raise TensorDtypeError(
                f"dtype is {info.dtype}, expected {' or '.join(str(d) for d in allowed)}",
                file=str(info.file),
                tensor=info.name,
            )

    @staticmethod
    def expect_shape(info: TensorInfo, *shapes: tuple[int, ...]) -> None:
        if info.shape not in shapes:
            raise TensorShapeError(
                f"shape is {list(info.shape)}, config.json implies "
                f"{' or '.join(str(list(s)) for s in shapes)}",
                file=str(info.file),
                tensor=info.name,
            )

    def scale(self, name: str, *shapes: tuple[int, ...]) -> torch.Tensor:
        """The float32 scale ``name`` of one of ``shapes``, read, checked and kept."""
        info = self.info(name)
        self.expect_dtype(info, (torch.float32,))
        self.expect_shape(info, *shapes)
        value = self.ckpt.read(name).to(torch.float32)
        bad = ~torch.isfinite(value) | (value <= 0)
        if bool(bad.any()):
            first = float(value.reshape(-1)[bad.reshape(-1)][0])
            raise InvalidScaleError(
                f"scale must be finite and positive, found {first}",
                file=str(info.file),
                tensor=name,
            )
        self.scales[name] = value
        return value
