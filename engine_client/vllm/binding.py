"""Binding: every leased tensor becomes the parameter vLLM's default loader would have left,
zero-copy. The linear layers take their processed ``[K, N]`` weight and scales with the state
vLLM's post-load processing would have set; the embeddings and LM head take this rank's padded
vocabulary rows; the norms their weights. Each keeps vLLM's parameter class and loader
attributes, and a parameter vLLM shares between modules (a tied LM head) stays one object.
Nothing is copied and nothing is written into leased memory.

A lease that does not fit the model vLLM built is refused (``layout_mismatch``) before any of
its tensors is used in that place."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine_client.attach import Attachment
from engine_client.vllm.internals import (
    linear_shape,
    parameter_like,
    set_processed_state,
    vocab_shard,
)
from modelopt_fp8.schemes import scheme_named
from protocol.errors import VerificationError
from protocol.reasons import Reason
from protocol.schemas.layout import CarriedKind, CarriedLayout, LayerLayout

__all__ = ["ModelParameters", "bind_attachment", "bind_linear"]


def _layout_error(detail: str, **extra: object) -> VerificationError:
    return VerificationError(detail, reason=Reason.layout_mismatch, **extra)


class ModelParameters:
    """Every place a parameter sits in the model, so one tensor replaces it everywhere (a tied
    LM head is ``embed_tokens.weight`` itself, registered in two modules). Torch's own
    ``Module._parameters`` is read and written directly: ``register_parameter``'s checks would
    add milliseconds over an 8B model's tensors, all on the load's timed path."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = dict(model.named_modules(remove_duplicate=False))
        self.by_name: dict[str, nn.Parameter] = {}
        self.places: dict[int, list[tuple[nn.Module, str]]] = {}
        for module_name, module in self.modules.items():
            for leaf, param in module._parameters.items():
                if param is None:
                    continue
                name = f"{module_name}.{leaf}" if module_name else leaf
                self.by_name[name] = param
                self.places.setdefault(id(param), []).append((module, leaf))

    def module(self, name: str) -> Any:
        """The vLLM module ``name`` (typed loosely: its attributes are vLLM's)."""
        module = self.modules.get(name)
        if module is None:
            raise _layout_error(f"vLLM's model has no module {name}", layer=name)
        return module

    def replace(self, module: nn.Module, leaf: str, tensor: torch.Tensor | None) -> None:
        """Put ``tensor`` where ``module.leaf`` is, in every place that parameter sits, as a
        parameter of the same class with the same loader attributes; None removes it."""
        old = module._parameters.get(leaf)
        if tensor is None:
            if old is not None:
                setattr(module, leaf, None)
            return
        if old is None:
            module.register_parameter(leaf, nn.Parameter(tensor, requires_grad=False))
            return
        new = parameter_like(old, tensor)
        for place, place_leaf in self.places.pop(id(old), [(module, leaf)]):
            place._parameters[place_leaf] = new
        self.places[id(new)] = [(module, leaf)]

    def bind(self, name: str, tensor: torch.Tensor) -> None:
        """Bind a whole tensor under vLLM's parameter ``name``; dtype and shape must agree."""
        param = self.by_name.get(name)
        if param is None:
            raise _layout_error(f"vLLM's model has no parameter {name}", tensor=name)
        if param.dtype != tensor.dtype or param.shape != tensor.shape:
            raise _layout_error(
                f"{name}: vLLM holds {param.dtype} {list(param.shape)}, the lease "
                f"{tensor.dtype} {list(tensor.shape)}",
                tensor=name,
            )
        module_name, _, leaf = name.rpartition(".")
        self.replace(self.modules[module_name], leaf, tensor)


def _check_linear_shape(module: nn.Module, layout: LayerLayout) -> None:
    """The leased layer must be the layer vLLM built: same fused widths on this rank."""
    built = linear_shape(module)
    if built is not None and built != (layout.logical_widths, layout.input_size):
        raise _layout_error(
            f"{layout.name}: vLLM built widths {built.logical_widths} x {built.input_size}, "
            f"the lease holds {layout.logical_widths} x {layout.input_size}",
            layer=layout.name,
        )


def bind_linear(
    params: ModelParameters, layout: LayerLayout, tensors: dict[str, torch.Tensor]
) -> None:
    """Leave on one linear layer exactly what ``process_weights_after_loading`` would have."""
    module = params.module(layout.name)
    _check_linear_shape(module, layout)
    params.replace(module, "weight", tensors[layout.weight])
    if layout.bias is not None:
        params.replace(module, "bias", tensors[layout.bias])
    scheme = scheme_named(layout.scheme)
    for leaf, name in scheme.bound_scales(layout).items():
        params.replace(module, leaf, tensors[name] if name else None)
    if scheme.sets_kernel_state:
        set_processed_state(module, layout)


def _check_vocab_shard(module: nn.Module, layout: CarriedLayout) -> None:
    shard = vocab_shard(module)
    if shard is None:
        raise _layout_error(f"{layout.name} is not a vocabulary-parallel module in vLLM")
    ours = (layout.vocab_size, layout.vocab_start, layout.vocab_end, layout.padding_size)
    theirs = (shard.vocab_size, shard.start, shard.end, shard.padding_size)
    if ours != theirs or shard.added_embeddings:
        raise _layout_error(
            f"{layout.name}: vLLM shards the vocabulary as (size, start, end, padding) "
            f"{theirs}, the lease {ours}",
            tensor=layout.name,
        )


def bind_attachment(model: nn.Module, attachment: Attachment) -> list[str]:
    """Bind every leased tensor vLLM holds as is; return the names its loaders must consume
    (the checkpoint's KV-cache scales)."""
    params = ModelParameters(model)
    manifest = attachment.manifest
    for layout in manifest.layers:
        bind_linear(params, layout, attachment.tensors)
    to_load = []
    for carried in manifest.carried:
        if carried.kind is CarriedKind.checkpoint:
            to_load.append(carried.name)
            continue
        if carried.kind is CarriedKind.vocab_parallel:
            _check_vocab_shard(params.module(carried.name.rpartition(".")[0]), carried)
        params.bind(carried.name, attachment.tensors[carried.name])
    return to_load
