"""An unquantized bf16 checkpoint, as ``save_pretrained`` writes one: no quantization config,
every weight bf16 (the way the daemon's ``unquantized`` scheme holds a layer a config excludes).
The daemon does not process it: engines load it with vLLM's loader and donate it."""

from __future__ import annotations

from typing import Any

from modelopt_fp8.checkpoint.architecture import LinearSpec
from modelopt_fp8.schemes import unquantized
from service.demo_formats.base import SchemeFormat


class Bf16(SchemeFormat):
    name = "bf16"
    kv_cache_scales = False

    def check_layer(self, spec: LinearSpec) -> None:
        """Any shape."""

    def quantization_config(self, kv_cache: bool) -> dict[str, Any] | None:
        return None


FORMAT = Bf16(unquantized.SCHEME)
