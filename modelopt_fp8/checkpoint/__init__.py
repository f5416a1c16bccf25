"""Reading ModelOpt FP8 checkpoints: configs, architectures, safetensors files, fingerprints."""

from modelopt_fp8.checkpoint.architecture import LinearSpec, ModelDims, Parallelism, ShardSpec
from modelopt_fp8.checkpoint.checkpoint import Checkpoint
from modelopt_fp8.checkpoint.fingerprint import (
    DEFAULT_TIER,
    Fingerprint,
    IdentityTier,
    checkpoint_fingerprint,
)
from modelopt_fp8.checkpoint.quant_config import (
    FP8,
    FP8_PER_CHANNEL_PER_TOKEN,
    SUPPORTED_QUANT_ALGOS,
    QuantConfig,
)

__all__ = [
    "DEFAULT_TIER",
    "FP8",
    "FP8_PER_CHANNEL_PER_TOKEN",
    "SUPPORTED_QUANT_ALGOS",
    "Checkpoint",
    "Fingerprint",
    "IdentityTier",
    "LinearSpec",
    "ModelDims",
    "Parallelism",
    "QuantConfig",
    "ShardSpec",
    "checkpoint_fingerprint",
]
