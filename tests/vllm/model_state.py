"""A vLLM model's whole state, to compare two loads of the same checkpoint: every parameter,
buffer and tensor attribute (dtype, shape, stride, device, class, bytes), which names share one
tensor, the loader attributes on parameters, and the plain attributes of every module and of
its quant method and kernel."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import xxhash
from torch import nn

PLAIN = (int, float, bool, str, type(None))
# Attributes that differ between two loads by construction, not by what the model computes.
IGNORED_ATTRIBUTES = frozenset({"training"})


def _plain(value: Any) -> Any:
    """A comparable form of a plain attribute, or None if it is not plain data."""
    if isinstance(value, PLAIN):
        return repr(value)
    if isinstance(value, (tuple, list)) and all(isinstance(v, PLAIN) for v in value):
        return repr(tuple(value))
    if isinstance(value, torch.dtype):
        return repr(value)
    return None


def _digest(t: torch.Tensor) -> str:
    if t.is_meta:
        return "meta"
    data = t.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    raw = data.contiguous().view(-1).view(torch.uint8) if data.numel() else data.new_empty(0)
    return xxhash.xxh3_64_hexdigest(raw.numpy().tobytes()) if raw.numel() else "empty"


def _tensor(t: torch.Tensor) -> tuple[object, ...]:
    return (
        type(t).__name__,
        str(t.dtype),
        tuple(t.shape),
        tuple(t.stride()),
        t.device.type,
        _digest(t),
    )


def _attributes(obj: object) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in vars(obj).items():
        if key in IGNORED_ATTRIBUTES or key in ("_parameters", "_buffers", "_modules"):
            continue
        if isinstance(value, torch.Tensor):
            continue
        if callable(value):
            out[key] = f"callable {getattr(value, '__qualname__', type(value).__name__)}"
            continue
        plain = _plain(value)
        if plain is not None:
            out[key] = plain
    return out


@dataclass
class ModelState:
    tensors: dict[str, tuple[object, ...]]
    aliases: dict[str, str]  # name -> first name holding the same tensor object
    attributes: dict[str, object]

    def differences(self, other: ModelState) -> list[str]:
        out = []
        for mine, theirs, what in (
            (self.tensors, other.tensors, "tensor"),
            (self.aliases, other.aliases, "sharing"),
            (self.attributes, other.attributes, "attribute"),
        ):
            for name in sorted(set(mine) | set(theirs)):
                if mine.get(name) != theirs.get(name):
                    out.append(f"{what} {name}: {mine.get(name)!r} != {theirs.get(name)!r}")
        return out


def model_state(model: nn.Module) -> ModelState:
    tensors: dict[str, tuple[object, ...]] = {}
    aliases: dict[str, str] = {}
    attributes: dict[str, object] = {}
    first: dict[int, str] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        # torch's own enumeration of this module's parameters and buffers (every name of a shared
        # one kept), not the dicts behind it that the donation walk reads
        own = {"recurse": False, "remove_duplicate": False}
        named: list[tuple[str, str, torch.Tensor]] = [
            *(("param", k, v) for k, v in module.named_parameters(**own)),
            *(("buffer", k, v) for k, v in module.named_buffers(**own)),
        ]
        named += [
            ("attr", k, v)
            for k, v in vars(module).items()
            if isinstance(v, torch.Tensor) and k not in ("_parameters", "_buffers")
        ]
        for kind, store in (("param", module._parameters), ("buffer", module._buffers)):
            # A slot registered empty (``bias`` None): forward reads it as an attribute.
            tensors.update({prefix + k: (kind, None) for k, v in store.items() if v is None})
        for kind, leaf, value in named:
            name = prefix + leaf
            tensors[name] = (kind, *_tensor(value))
            aliases[name] = first.setdefault(id(value), name)
            if kind == "param":
                for key, attr in _attributes(value).items():
                    attributes[f"{name}.{key}"] = attr
        for key, attr in _attributes(module).items():
            attributes[prefix + key] = attr
        method = getattr(module, "quant_method", None)
        if method is not None:
            attributes[prefix + "quant_method"] = type(method).__name__
            kernel = getattr(method, "kernel", None)
            attributes[prefix + "kernel"] = type(kernel).__name__
            for owner, obj in (("quant_method", method), ("kernel", kernel)):
                if obj is not None and hasattr(obj, "__dict__"):
                    for key, attr in _attributes(obj).items():
                        attributes[f"{prefix}{owner}.{key}"] = attr
    return ModelState(tensors, aliases, attributes)
