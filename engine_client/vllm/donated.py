"""Donated models inside vLLM: the key of this engine's rank, what vLLM's loading and
processing left on the model (captured around the donor's own load), and that state bound onto
a model built on the meta device (the attacher's).

The donor loads as vLLM's default loader does (``BaseModelLoader.load_model``: build on the
target device, ``load_weights``, ``process_weights_after_loading``), with a snapshot of every
module's plain and callable attributes after the build and after the processing: what changed
is what processing set. Tensors travel in the arena; plain attributes in the donation's state;
a callable only where this loader rebuilds it with vLLM's own code
(:func:`.internals.runtime_rebuilder`), else the donation is refused with the attribute named.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from vllm.model_executor.model_loader.utils import process_weights_after_loading

from engine_client.attach import Attachment
from engine_client.vllm.engine_start import checkpoint_digests
from engine_client.vllm.internals import (
    kernel_of,
    parameter_like,
    picked_kernels,
    rebuild_runtime,
    runtime_rebuilder,
    vllm_version,
)
from engine_client.vllm.runtime_state import build_runtime_state, require_materialized
from modelopt_fp8.checkpoint import IdentityTier
from protocol.devices import Placement
from protocol.errors import VerificationError
from protocol.reasons import Reason
from protocol.schemas.donated import (
    DonatedState,
    DonatedTensorRole,
    DonationKey,
    PlainAttribute,
)
from protocol.schemas.manifest import DeviceKind

__all__ = ["bind_donated", "capture", "donation_key", "known_fields", "processed_load", "snapshot"]

_PLAIN = (int, float, bool, str, type(None))
_SKIPPED = frozenset({"training", "_parameters", "_buffers", "_modules"})
OWNERS = ("module", "quant_method", "kernel")
# The checkpoint's identity tiers a donated model's key names (the cheap ones).
KEY_TIERS = (IdentityTier.files, IdentityTier.sampled, IdentityTier.hf_blob)


# --- the key --------------------------------------------------------------------------------


def known_fields(
    vllm_config: Any,
    model_config: Any,
    checkpoint: Any,
    device: torch.device,
    tp_rank: int,
    tp_size: int,
) -> dict[str, Any]:
    """The fields of this rank's key known before the model is built: all but the model class
    and the kernels vLLM picks."""
    tiers = checkpoint_digests(vllm_config, checkpoint, KEY_TIERS)
    kind = DeviceKind.cuda if device.type == "cuda" else DeviceKind.cpu
    if kind is DeviceKind.cuda:
        identity = Placement(kind, device.index).identity()
        name, capability, uuid = identity.name, identity.compute_capability, identity.uuid
    else:
        name, capability, uuid = f"cpu {torch.backends.cpu.get_cpu_capability()}", None, None
    return {
        "files": tiers[IdentityTier.files],
        "sampled": tiers[IdentityTier.sampled],
        "hf_blob": tiers[IdentityTier.hf_blob],
        "vllm_version": vllm_version(),
        "torch_version": torch.__version__,
        "quantization": model_config.quantization,
        "dtype": str(model_config.dtype),
        "kv_cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "device_kind": kind.value,
        "device_name": name,
        "compute_capability": capability,
        "device_uuid": uuid,
        "tp_rank": tp_rank,
        "tp_size": tp_size,
        "max_model_len": int(model_config.max_model_len),
        "checkpoint_path": str(checkpoint),
    }


def donation_key(
    vllm_config: Any,
    model_config: Any,
    model: nn.Module,
    checkpoint: Any,
    device: torch.device,
    tp_rank: int,
    tp_size: int,
) -> DonationKey:
    """What decides this rank's processed bytes: the checkpoint at its cheap identity tiers, the
    model class, vLLM and torch, the quantization and kernels picked, dtypes, the device, the TP
    rank and size, and the context length its constructors size buffers for."""
    known = known_fields(vllm_config, model_config, checkpoint, device, tp_rank, tp_size)
    return DonationKey(**known, architecture=type(model).__name__, kernels=picked_kernels(model))


# --- what processing set --------------------------------------------------------------------


def _owners(module: nn.Module) -> Iterator[tuple[str, object]]:
    yield "module", module
    method = getattr(module, "quant_method", None)
    if method is not None:
        yield "quant_method", method
    kernel = kernel_of(module)
    if kernel is not None:
        yield "kernel", kernel


def _attribute(value: object) -> PlainAttribute | str | None:
    """A plain value as it travels, a callable as its qualified name, None for anything else
    (tensors travel in the arena; other objects are not compared)."""
    if isinstance(value, torch.dtype):
        return PlainAttribute(kind="dtype", value=str(value).removeprefix("torch."))
    if isinstance(value, _PLAIN):
        return PlainAttribute(kind="plain", value=value)
    if isinstance(value, (tuple, list)) and all(isinstance(v, _PLAIN) for v in value):
        return PlainAttribute(
            kind="tuple" if isinstance(value, tuple) else "list", value=list(value)
        )
    if callable(value) and not isinstance(value, (nn.Module, torch.Tensor)):
        return f"callable {getattr(value, '__qualname__', type(value).__name__)}"
    return None


Snapshot = dict[str, PlainAttribute | str]


def snapshot(model: nn.Module) -> Snapshot:
    """Every plain and callable attribute of every module, its quant method and its kernel, by
    ``<module>|<owner>|<attribute>``."""
    out: Snapshot = {}
    for module_name, module in model.named_modules():
        for owner, obj in _owners(module):
            for key, value in vars(obj).items():
                if key in _SKIPPED or isinstance(value, torch.Tensor):
                    continue
                seen = _attribute(value)
                if seen is not None:
                    out[f"{module_name}|{owner}|{key}"] = seen
    return out


def _tensor_roles(
    model: nn.Module, device: torch.device
) -> tuple[list[DonatedTensorRole], dict[str, torch.Tensor]]:
    """Every parameter, buffer and tensor attribute (in ``named_modules`` order, sharing kept as
    aliases; those held on the host while the model is on ``device``, another device, marked),
    and the tensors to copy: one per tensor object."""
    roles: list[DonatedTensorRole] = []
    tensors: dict[str, torch.Tensor] = {}
    first: dict[int, str] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        found: list[tuple[str, str, torch.Tensor]] = []
        found += [("param", k, v) for k, v in module._parameters.items() if v is not None]
        found += [("buffer", k, v) for k, v in module._buffers.items() if v is not None]
        found += [
            ("attr", k, v)
            for k, v in vars(module).items()
            if isinstance(v, torch.Tensor) and k not in ("_parameters", "_buffers")
        ]
        for kind, leaf, value in found:
            name = prefix + leaf
            alias = first.setdefault(id(value), name)
            roles.append(
                DonatedTensorRole(
                    name=name,
                    kind=kind,
                    parameter_class=type(value).__name__ if kind == "param" else None,
                    requires_grad=value.requires_grad,
                    alias_of=None if alias == name else alias,
                    on_host=value.device.type == "cpu" and device.type != "cpu",
                )
            )
            if alias == name:
                tensors[name] = value.detach()
    return roles, tensors


def capture(
    model: nn.Module, before: Snapshot, device: torch.device
) -> tuple[DonatedState, dict[str, torch.Tensor]]:
    """The state an attacher sets besides the tensors, and the tensors, of a model vLLM loaded
    and processed on ``device``; ``before``: its :func:`snapshot` right after it was built."""
    after = snapshot(model)
    modules = dict(model.named_modules())
    attributes: dict[str, PlainAttribute] = {}
    runtime: dict[str, str] = {}
    for key, value in after.items():
        if before.get(key) == value:
            continue
        if isinstance(value, PlainAttribute):
            attributes[key] = value
            continue
        module_name, owner, attribute = key.split("|")
        rebuilder = (
            runtime_rebuilder(modules[module_name], attribute) if owner == "module" else None
        )
        if rebuilder is None:
            raise VerificationError(
                f"vLLM's processing set {module_name or 'the model'}'s {owner} attribute "
                f"{attribute} to a {value} this loader cannot rebuild on another engine",
                reason=Reason.donation_unsupported,
                attribute=key,
            )
        runtime[key] = rebuilder
    removed = sorted(set(before) - set(after))
    if removed:
        raise VerificationError(
            f"vLLM's processing removed the attribute {removed[0]}, which an attacher cannot "
            "remove by name",
            reason=Reason.donation_unsupported,
        )
    roles, tensors = _tensor_roles(model, device)
    return DonatedState(roles=roles, attributes=attributes, runtime=runtime), tensors


def processed_load(
    create: Callable[[], nn.Module],
    load_weights: Callable[[nn.Module], None],
    model_config: Any,
    device: torch.device,
) -> tuple[nn.Module, Snapshot]:
    """vLLM's default load (``BaseModelLoader.load_model``'s steps), with the snapshot after
    the build that :func:`capture` compares the processed model with."""
    with torch.device(device):
        model = create()
    before = snapshot(model)
    load_weights(model)
    process_weights_after_loading(model, model_config, device)
    return model, before


# --- binding a donation ---------------------------------------------------------------------


def _owner_object(module: nn.Module, owner: str) -> object:
    if owner == "module":
        return module
    if owner == "quant_method":
        return module.quant_method
    return kernel_of(module)


def _value(attribute: PlainAttribute) -> object:
    if attribute.kind == "dtype":
        return getattr(torch, str(attribute.value))
    if attribute.kind == "tuple":
        assert isinstance(attribute.value, list)
        return tuple(attribute.value)
    return attribute.value


def _place(module: nn.Module, role: DonatedTensorRole, value: torch.Tensor) -> torch.Tensor:
    """Put ``value`` where ``role`` says, as the class the donor held; returns what was set."""
    leaf = role.name.rsplit(".", 1)[-1]
    if role.kind == "param":
        old = module._parameters.get(leaf)
        if isinstance(value, nn.Parameter):
            new = value  # an alias: the very object the first name holds
        elif old is not None and type(old).__name__ == role.parameter_class:
            new = parameter_like(old, value)
        elif role.parameter_class == nn.Parameter.__name__:
            new = nn.Parameter(value, requires_grad=False)
        else:
            raise VerificationError(
                f"{role.name} is a {role.parameter_class} in the donation, which this engine "
                "did not build there",
                reason=Reason.bind_failed,
                tensor=role.name,
            )
        module._parameters[leaf] = new
        return new
    if role.kind == "buffer":
        module._buffers[leaf] = value
    else:
        module.__dict__[leaf] = value
    return value


def _drop_unlisted(model: nn.Module, listed: set[str]) -> None:
    """Remove the tensors the build made that the donor's processing no longer had; a slot
    the build registered empty (``bias`` None) stays, as forward reads it."""
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for store in (module._parameters, module._buffers):
            for leaf in [k for k, v in store.items() if v is not None and prefix + k not in listed]:
                del store[leaf]
        for leaf in [
            k
            for k, v in vars(module).items()
            if isinstance(v, torch.Tensor) and prefix + k not in listed
        ]:
            del module.__dict__[leaf]


def bind_donated(model: nn.Module, attachment: Attachment, device: torch.device) -> None:
    """Make ``model`` (built on the meta device, or the donor's own) hold the donation: every
    tensor a zero-copy view of the arena with the donor's class and sharing, every attribute
    processing set, the callables it set rebuilt by vLLM's code; nothing left on meta."""
    donation = attachment.manifest.donation
    if donation is None:
        raise VerificationError(
            "the lease is not of a donated model", reason=Reason.manifest_invalid
        )
    state = donation.state
    modules = dict(model.named_modules(remove_duplicate=False))
    placed: dict[str, torch.Tensor] = {}
    for role in state.roles:
        module_name = role.name.rsplit(".", 1)[0] if "." in role.name else ""
        module = modules.get(module_name)
        if module is None:
            raise VerificationError(
                f"the donation holds {role.name}, a module this engine did not build",
                reason=Reason.bind_failed,
                tensor=role.name,
            )
        if role.alias_of:
            value = placed[role.alias_of]
        elif role.on_host:  # a copy: the arena is on the GPU, the donor held it on the host
            value = attachment.tensors[role.name].to("cpu", copy=True)
        else:
            value = attachment.tensors[role.name]
        placed[role.name] = _place(module, role, value)
    _drop_unlisted(model, {role.name for role in state.roles})
    build_runtime_state(model, device)
    for key, attribute in state.attributes.items():
        module_name, owner, name = key.split("|")
        setattr(_owner_object(modules[module_name], owner), name, _value(attribute))
    for key, rebuilder in state.runtime.items():
        module_name, _, _ = key.split("|")
        rebuild_runtime(modules[module_name], rebuilder)
    require_materialized(model)
