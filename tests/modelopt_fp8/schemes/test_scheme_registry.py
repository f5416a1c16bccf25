"""The quantization schemes are found in one registry by name: each served ModelOpt algorithm is
one scheme, a layer a config excludes is the unquantized one, and a name no scheme answers to is
refused by that name, never read as another scheme."""

from __future__ import annotations

import subprocess
import sys

import pytest

from modelopt_fp8.checkpoint.quant_config import QuantConfig
from modelopt_fp8.schemes import SCHEMES, SERVED_ALGOS, demo_schemes, scheme_named, scheme_serving
from protocol.errors import VerificationError
from protocol.reasons import Reason


def test_every_scheme_has_its_own_name_and_algorithm() -> None:
    names = [s.name for s in SCHEMES]
    algos = [s.quant_algo for s in SCHEMES]
    assert len(set(names)) == len(names) and len(set(algos)) == len(algos)
    assert set(SERVED_ALGOS) == {a for a in algos if a is not None}
    for scheme in SCHEMES:
        assert scheme_named(scheme.name) is scheme
        assert scheme_serving(scheme.quant_algo) is scheme


@pytest.mark.parametrize("name", ["fp8_block", "FP8", "", "unquantised"])
def test_a_name_no_scheme_answers_to_is_refused_by_name(name: str) -> None:
    with pytest.raises(VerificationError) as err:
        scheme_named(name)
    assert err.value.reason is Reason.unsupported_layer
    assert repr(name) in err.value.detail and err.value.extra["scheme"] == name


def test_a_config_gives_its_algorithm_s_scheme_and_excluded_layers_none() -> None:
    for algo in SERVED_ALGOS:
        config = QuantConfig(algo, None, ("model.layers.1.mlp.down_proj",), "x")
        assert config.scheme_for("model.layers.0.mlp.down_proj") is scheme_serving(algo)
        excluded = config.scheme_for("model.layers.1.mlp.down_proj")
        assert excluded is scheme_serving(None) and excluded.quant_algo is None


def test_the_demo_writes_every_served_scheme() -> None:
    assert {s.quant_algo for s in demo_schemes().values()} == set(SERVED_ALGOS)
    assert set(demo_schemes()) == {"fp8", "fp8-pc-pt"}


@pytest.mark.parametrize(
    "module",
    ["modelopt_fp8.schemes", "modelopt_fp8.checkpoint", "modelopt_fp8.processing.plan"],
)
def test_each_layer_imports_first_in_a_fresh_interpreter(module: str) -> None:
    """The checkpoint's config asks the registry, the schemes use the processing's building
    blocks, the planner uses both: whichever is imported first, none finds another half-made."""
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True, timeout=120)
