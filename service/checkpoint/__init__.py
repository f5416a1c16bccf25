"""Reading ModelOpt FP8 checkpoints: configs, architectures, safetensors files, fingerprints."""

from service.checkpoint.architecture import LinearSpec, ModelDims, Parallelism, ShardSpec
from service.checkpoint.checkpoint import Checkpoint
from service.checkpoint.fingerprint import (
    DEFAULT_TIER,
    Fingerprint,
    IdentityTier,
    checkpoint_fingerprint,
)
from service.checkpoint.quant_config import (
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
