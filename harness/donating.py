"""A donation without vLLM, for the daemon's tests: a key for a checkpoint directory and a few
host tensors, given through the engine side's own calls (``engine_client.donations``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine_client.client import ClientConfig
from engine_client.donations import donate
from modelopt_fp8.checkpoint import IdentityTier
from modelopt_fp8.checkpoint.fingerprint import checkpoint_fingerprint
from protocol.devices import Placement
from protocol.schemas.donated import DonatedState, DonatedTensorRole, DonationKey
from protocol.schemas.manifest import DeviceKind


def key_for(checkpoint: Path, **over: Any) -> DonationKey:
    """A CPU donation key for ``checkpoint`` (its real identity tiers), fields overridable."""
    tiers = {t: checkpoint_fingerprint(checkpoint, t).digest for t in IdentityTier}
    fields: dict[str, Any] = {
        "files": tiers[IdentityTier.files],
        "sampled": tiers[IdentityTier.sampled],
        "hf_blob": tiers[IdentityTier.hf_blob],
        "architecture": "LlamaForCausalLM",
        "vllm_version": "0.33.0",
        "torch_version": torch.__version__,
        "quantization": None,
        "kernels": ["UnquantizedLinearMethodx4"],
        "dtype": "torch.bfloat16",
        "kv_cache_dtype": "auto",
        "device_kind": "cpu",
        "device_name": "cpu test",
        "compute_capability": None,
        "tp_rank": 0,
        "tp_size": 1,
        "max_model_len": 256,
        "checkpoint_path": str(checkpoint),
    }
    fields.update(over)
    return DonationKey(**fields)


# A key's device fields for a GPU no host has (its UUID is made up): a daemon refuses it.
ABSENT_GPU: dict[str, Any] = {
    "device_kind": "cuda",
    "device_name": "NVIDIA H100 80GB HBM3",
    "compute_capability": "9.0",
    "device_uuid": "GPU-00000000-1111-2222-3333-444444444444",
}


def gpu_fields(index: int = 0) -> dict[str, Any]:
    """A key's device fields for this process's GPU ``index``, as an engine there makes them."""
    gpu = Placement(DeviceKind.cuda, index).identity()
    return {
        "device_kind": "cuda",
        "device_name": gpu.name,
        "compute_capability": gpu.compute_capability,
        "device_uuid": gpu.uuid,
    }


def some_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """A few tensors as a processed rank holds them: a transposed (non-contiguous) weight,
    a bias, a scalar scale."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(48, 32, generator=generator).to(torch.bfloat16)
    return {
        "layer.weight": weight.t(),
        "layer.bias": torch.randn(48, generator=generator).to(torch.bfloat16),
        "layer.scale": torch.tensor(0.5, dtype=torch.float32),
    }


def state_of(tensors: dict[str, torch.Tensor]) -> DonatedState:
    return DonatedState(
        roles=[
            DonatedTensorRole(name=name, kind="param", parameter_class="Parameter")
            for name in tensors
        ],
        attributes={},
    )


def donate_tensors(
    url: str, key: DonationKey, tensors: dict[str, torch.Tensor] | None = None
) -> str:
    """Donate ``tensors`` (default :func:`some_tensors`) under ``key``; the model's id."""
    tensors = tensors if tensors is not None else some_tensors()
    return donate(ClientConfig.from_env(url=url), key, tensors, state_of(tensors))
