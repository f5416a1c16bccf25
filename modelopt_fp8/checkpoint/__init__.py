"""Reading ModelOpt FP8 checkpoints: configs, architectures, safetensors files, fingerprints."""

from modelopt_fp8.checkpoint.architecture import LinearSpec, ModelDims, Parallelism, ShardSpec
from modelopt_fp8.checkpoint.checkpoint import Checkpoint
from modelopt_fp8.checkpoint.fingerprint import (
    DEFAULT_TIER,
    Fingerprint,
    IdentityTier,
    checkpoint_fingerprint,
)
from modelopt_fp8.checkpoint.quant_config import QuantConfig

__all__ = [
    "DEFAULT_TIER",
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
