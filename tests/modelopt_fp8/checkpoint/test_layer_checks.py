"""What a config promises is held against the headers before anything is built: first their
lengths (room for the promised layers' weights), then their bytes (how many tensors, which
layers they name), then, once parsed, the linear weights of every layer by name, stopping at
the first layer that falls short."""

from __future__ import annotations

import json

import pytest

from modelopt_fp8.checkpoint.architecture import (
    check_header_room,
    check_layers,
    check_raw_headers,
    layer_weight_names,
    read_dims,
)
from protocol.errors import InvalidConfigError, MissingTensorError
from tests.modelopt_fp8.checkpoint.test_model_architectures import config

DIMS = read_dims(config(num_hidden_layers=3), "config.json")
WEIGHTS = len(layer_weight_names(DIMS, 0))


def header(names: list[str]) -> bytes:
    """A header's bytes listing ``names`` as zero-size tensors."""
    entry = {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
    return json.dumps(dict.fromkeys(names, entry)).encode()


def every_weight(layers: int) -> list[str]:
    return [name for i in range(layers) for name in layer_weight_names(DIMS, i)]


def test_a_complete_stack_passes_both_checks() -> None:
    names = every_weight(3)
    check_raw_headers(DIMS, [header(names[:10]), header(names[10:])], "c")
    check_layers(DIMS, dict.fromkeys(names, (0,)), "c")


def test_headers_too_short_for_the_promised_weights_are_refused_by_their_length() -> None:
    exact = len(header(every_weight(3)))
    check_header_room(DIMS, exact, "c")  # real entries are longer than the least
    with pytest.raises(InvalidConfigError, match="bytes of safetensors headers, which hold 900"):
        check_header_room(DIMS, 900, "c")


def test_fewer_tensors_than_the_layers_need_are_refused_from_the_bytes() -> None:
    with pytest.raises(InvalidConfigError, match=f"{3 * WEIGHTS} linear weights.*at most 20"):
        check_raw_headers(DIMS, [header(every_weight(3)[:20])], "c")


def test_a_layer_past_the_promised_ones_is_refused_from_the_bytes() -> None:
    names = [*every_weight(3), "model.layers.7.x"]
    with pytest.raises(InvalidConfigError, match="name layer 7"):
        check_raw_headers(DIMS, [header(names)], "c")


def test_a_layer_named_by_too_few_tensors_is_refused_from_the_bytes() -> None:
    names = [n for n in every_weight(3) if ".1." not in n or "q_proj" not in n]
    names += ["model.norm.weight"]
    with pytest.raises(InvalidConfigError, match=f"name {WEIGHTS - 1} tensors of layer 1"):
        check_raw_headers(DIMS, [header(names)], "c")


def test_headers_listing_no_tensor_are_left_to_the_parse() -> None:
    check_raw_headers(DIMS, [b'{"x": [[[]]]}'], "c")  # the parse calls it corrupt


def test_a_layer_whose_count_is_right_but_a_weight_is_missing_is_named() -> None:
    """Bytes can only overcount: a layer with enough tensors, one of them not a weight it
    needs, passes them and is refused once parsed, naming the weight."""
    names = every_weight(3)
    names[names.index("model.layers.1.mlp.up_proj.weight")] = "model.layers.1.mlp.other"
    check_raw_headers(DIMS, [header(names)], "c")
    with pytest.raises(MissingTensorError) as err:
        check_layers(DIMS, dict.fromkeys(names, (0,)), "c")
    assert err.value.extra["tensor"] == "model.layers.1.mlp.up_proj.weight"
