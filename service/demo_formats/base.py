"""What a demo checkpoint's format defines: one interface, :class:`DemoFormat`, for everything
the demo writer (``service/demo.py``) does differently from one export format to another.

A format says how a linear layer's float weight is written (its tensors and their names), what
``config.json``'s ``quantization_config`` says, whether an ``hf_quant_config.json`` is written
beside it, whether the KV-cache scales of a shape that has them are written, and which shapes it
can be written in. The ModelOpt formats are the schemes the daemon processes
(``modelopt_fp8/schemes/``); the others are formats engines load with vLLM's own loader and
donate (docs/donations.md).
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import Any

import torch

from modelopt_fp8.checkpoint.architecture import LinearSpec
from modelopt_fp8.schemes import LinearScheme


class DemoFormat(abc.ABC):
    name: str  # its name in ``weight-cache demo-checkpoint --scheme``
    kv_cache_scales: bool  # writes the KV-cache scales of a shape that has them
    # The daemon processes it (loads it with --model); else engines load it and donate it.
    processed_by_daemon = False

    @abc.abstractmethod
    def export(
        self, prefix: str, weight: torch.Tensor, input_scale: float
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """A shard's tensors as its exporter writes them, from its float ``weight`` and the
        input scale its fused layer shares (unused by formats without static input scales)."""

    @abc.abstractmethod
    def quantization_config(self, kv_cache: bool) -> dict[str, Any] | None:
        """``config.json``'s ``quantization_config`` (None: the key is absent)."""

    def hf_quant_config(self, kv_cache: bool) -> dict[str, Any] | None:
        """``hf_quant_config.json`` (None: not written)."""
        return None

    @abc.abstractmethod
    def check_layer(self, spec: LinearSpec) -> None:
        """Refuse (``ValueError``) a layer this format cannot be written in for vLLM."""


class SchemeFormat(DemoFormat):
    """A format whose weights one of the daemon's schemes writes (the ModelOpt ones, and bf16
    through the scheme that holds a layer a config excludes)."""

    def __init__(self, scheme: LinearScheme) -> None:
        self.scheme = scheme

    def export(
        self, prefix: str, weight: torch.Tensor, input_scale: float
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return self.scheme.export(prefix, weight, input_scale)
