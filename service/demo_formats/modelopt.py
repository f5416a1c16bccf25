"""ModelOpt's FP8 exports, one per scheme the daemon processes (``modelopt_fp8/schemes/``): each
weight as the scheme quantizes it, the ``modelopt`` quantization config and
``hf_quant_config.json``, as ``modelopt.torch.export.export_hf_checkpoint`` writes them."""

from __future__ import annotations

from typing import Any

from modelopt_fp8.checkpoint.architecture import LinearSpec
from modelopt_fp8.schemes import LinearScheme
from protocol.version import __version__
from service.demo_formats.base import SchemeFormat

PRODUCER = {"name": "weight-cache-demo", "version": __version__}
EXCLUDED = ["lm_head", "model.embed_tokens"]


class ModelOptFormat(SchemeFormat):
    kv_cache_scales = True
    processed_by_daemon = True

    def __init__(self, scheme: LinearScheme) -> None:
        assert scheme.quant_algo is not None, "the excluded layers' scheme is no export format"
        super().__init__(scheme)
        self.algo: str = scheme.quant_algo
        self.name = scheme.demo_name

    def check_layer(self, spec: LinearSpec) -> None:
        """Any shape (the daemon pads what CUTLASS needs)."""

    def quantization_config(self, kv_cache: bool) -> dict[str, Any]:
        config: dict[str, Any] = {
            "ignore": EXCLUDED,
            "quant_algo": self.algo,
            "producer": PRODUCER,
            "quant_method": "modelopt",
        }
        if kv_cache:
            config["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
        return config

    def hf_quant_config(self, kv_cache: bool) -> dict[str, Any]:
        return {
            "producer": PRODUCER,
            "quantization": {
                "quant_algo": self.algo,
                "kv_cache_quant_algo": "FP8" if kv_cache else None,
                "exclude_modules": EXCLUDED,
            },
        }
