"""ModelOpt quantization config, from either of the two forms ModelOpt exports.

* ``hf_quant_config.json``: ``{"producer": {...}, "quantization": {"quant_algo",
  "kv_cache_quant_algo", "exclude_modules"}}``
* ``config.json`` ``quantization_config``: ``{"quant_method": "modelopt", "quant_algo", "ignore",
  "kv_cache_scheme"}``

Layer exclusion follows vLLM 0.33's ``ModelOptQuantConfigBase.is_layer_excluded``: an exact match
on the fused name or on every one of its shards, then substring matching, then ``fnmatch``
wildcards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from modelopt_fp8.checkpoint.architecture import PACKED_MODULES
from modelopt_fp8.checkpoint.opened import CheckpointDir, parse_json_object
from modelopt_fp8.schemes import SERVED_ALGOS, LinearScheme, scheme_serving
from protocol.errors import (
    InvalidConfigError,
    NotModelOptCheckpointError,
    UnsupportedQuantAlgoError,
)

# What ModelOpt (and vLLM) know of but weight-cache does not serve pre-processed.
KNOWN_UNSUPPORTED_ALGOS = (
    "FP8_PB_WO",
    "FP8_BLOCK_SCALES",
    "NVFP4",
    "W4A16_NVFP4",
    "MXFP8",
    "MIXED_PRECISION",
    "INT4_AWQ",
    "W4A8_AWQ",
    "INT8_SQ",
)

HF_QUANT_CONFIG = "hf_quant_config.json"
MODEL_CONFIG = "config.json"


@dataclass(frozen=True)
class QuantConfig:
    """What the checkpoint says about its quantization."""

    quant_algo: str
    kv_cache_quant_algo: str | None
    exclude_modules: tuple[str, ...]
    source: str
    producer: dict[str, Any] = field(default_factory=dict)

    def is_excluded(self, prefix: str, packed: dict[str, tuple[str, ...]]) -> bool:
        """Whether vLLM would leave the linear layer at ``prefix`` unquantized.

        ``packed`` maps a fused projection name (``qkv_proj``) to its checkpoint shards.
        """
        if not self.exclude_modules:
            return False
        excluded = set(self.exclude_modules)
        proj = prefix.rsplit(".", 1)[-1]
        if proj in packed and prefix not in excluded:
            shard_hits = {prefix[: -len(proj)] + shard in excluded for shard in packed[proj]}
            if len(shard_hits) > 1:
                raise InvalidConfigError(
                    f"some but not all shards of {prefix} are excluded from quantization",
                    file=self.source,
                    tensor=prefix,
                )
            if shard_hits == {True}:
                return True
        elif prefix in excluded:
            return True
        for pattern in self.exclude_modules:
            if pattern != prefix and pattern in prefix:
                return True
        return any(fnmatch(prefix, pattern) for pattern in self.exclude_modules)

    def scheme_for(self, prefix: str) -> LinearScheme:
        """The scheme vLLM gives the linear layer at ``prefix`` under this config."""
        excluded = self.is_excluded(prefix, dict(PACKED_MODULES))
        return scheme_serving(None if excluded else self.quant_algo)


def _normalise_algo(raw: Any, source: str) -> str:
    if not isinstance(raw, str) or not raw:
        raise InvalidConfigError("missing 'quant_algo' in the quantization config", file=source)
    algo = raw.upper()
    if algo not in SERVED_ALGOS:
        known = (
            "a ModelOpt format weight-cache does not serve"
            if algo in KNOWN_UNSUPPORTED_ALGOS
            else "unknown"
        )
        raise UnsupportedQuantAlgoError(
            f"quant_algo {raw!r} is {known}; supported: {', '.join(SERVED_ALGOS)}",
            file=source,
            quant_algo=raw,
            supported=list(SERVED_ALGOS),
        )
    return algo


def _exclude_list(raw: Any, source: str) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw):
        raise InvalidConfigError("exclude_modules/ignore must be a list of strings", file=source)
    return tuple(raw)


def _kv_algo(raw: Any, source: str) -> str | None:
    if raw is None:
        return None
    if not isinstance(raw, str):
        raise InvalidConfigError("kv_cache_quant_algo must be a string", file=source)
    return raw.upper()


def _from_hf_quant_config(data: dict[str, Any], source: str) -> QuantConfig:
    producer = data.get("producer") or {}
    quant = data.get("quantization")
    if not isinstance(quant, dict):
        raise NotModelOptCheckpointError(
            "hf_quant_config.json has no 'quantization' object", file=source
        )
    return QuantConfig(
        quant_algo=_normalise_algo(quant.get("quant_algo"), source),
        kv_cache_quant_algo=_kv_algo(quant.get("kv_cache_quant_algo"), source),
        exclude_modules=_exclude_list(quant.get("exclude_modules"), source),
        source=source,
        producer=producer if isinstance(producer, dict) else {},
    )


def _from_quantization_config(qc: dict[str, Any], source: str) -> QuantConfig:
    if "quantization" in qc and isinstance(qc["quantization"], dict):
        # Some exports nest the hf_quant_config.json layout inside config.json.
        return _from_hf_quant_config(qc, source)
    kv_scheme = qc.get("kv_cache_scheme")
    kv_algo = None
    if (
        isinstance(kv_scheme, dict)
        and kv_scheme.get("type") == "float"
        and kv_scheme.get("num_bits") == 8
    ):
        kv_algo = "FP8"
    elif "kv_cache_quant_algo" in qc:
        kv_algo = _kv_algo(qc.get("kv_cache_quant_algo"), source)
    producer = qc.get("producer")
    return QuantConfig(
        quant_algo=_normalise_algo(qc.get("quant_algo"), source),
        kv_cache_quant_algo=kv_algo,
        exclude_modules=_exclude_list(qc.get("ignore", qc.get("exclude_modules")), source),
        source=source,
        producer=producer if isinstance(producer, dict) else {},
    )


def read_quant_config(directory: Path, model_config: dict[str, Any]) -> QuantConfig:
    """The checkpoint's ModelOpt config, reading ``hf_quant_config.json`` from ``directory``."""
    opened = CheckpointDir.open(directory)
    try:
        file = opened.open_file(HF_QUANT_CONFIG)
        hf_data = None
        if file is not None:
            try:
                hf_data = parse_json_object(file.read_all(), file)
            finally:
                file.close()
    finally:
        opened.close()
    return quant_config_from(directory, model_config, hf_data)


def quant_config_from(
    directory: Path, model_config: dict[str, Any], hf_data: dict[str, Any] | None
) -> QuantConfig:
    """The checkpoint's ModelOpt config from config.json and the parsed ``hf_quant_config.json``
    (None when absent); ``config.json`` wins over ``hf_quant_config.json`` as in vLLM, and the
    two must agree on the algorithm when both are present."""
    hf_path = directory / HF_QUANT_CONFIG
    from_hf = _from_hf_quant_config(hf_data, str(hf_path)) if hf_data is not None else None

    qc = model_config.get("quantization_config")
    from_model: QuantConfig | None = None
    source = str(directory / MODEL_CONFIG)
    if isinstance(qc, dict):
        method = str(qc.get("quant_method", "")).lower()
        if method.startswith("modelopt"):
            from_model = _from_quantization_config(qc, source)
        elif from_hf is None:
            raise NotModelOptCheckpointError(
                f"quantization_config.quant_method is {qc.get('quant_method')!r}, not 'modelopt'",
                file=source,
            )
    if from_model is None and from_hf is None:
        raise NotModelOptCheckpointError(
            "no hf_quant_config.json and no modelopt quantization_config in config.json",
            file=str(directory),
        )
    if (
        from_model is not None
        and from_hf is not None
        and from_model.quant_algo != from_hf.quant_algo
    ):
        raise InvalidConfigError(
            f"config.json says {from_model.quant_algo} but hf_quant_config.json says "
            f"{from_hf.quant_algo}",
            file=source,
        )
    chosen = from_model or from_hf
    assert chosen is not None
    if from_model is not None and from_hf is not None and not from_model.producer:
        chosen = QuantConfig(
            quant_algo=from_model.quant_algo,
            kv_cache_quant_algo=from_model.kv_cache_quant_algo or from_hf.kv_cache_quant_algo,
            exclude_modules=from_model.exclude_modules or from_hf.exclude_modules,
            source=from_model.source,
            producer=from_hf.producer,
        )
    return chosen
