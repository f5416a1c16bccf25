"""The quantization schemes the cache serves, one module each behind one interface
(:class:`~modelopt_fp8.schemes.base.LinearScheme`), found here by name.

The checkpoint's quantization config asks :func:`scheme_serving` which scheme its ``quant_algo``
(or, for the layers it excludes, no algorithm) is served by; the planner, the processing, the
engine's checks and binding, the reference and the demo writer ask a layer's scheme. A name no
scheme here answers to is refused by name (:func:`scheme_named`), never read as another.

How to add a scheme: write ``modelopt_fp8/schemes/<scheme>.py`` with a :class:`LinearScheme`
(``cutlass_fp8.CutlassFp8Scheme`` for one on vLLM's CUTLASS FP8 kernel), add its ``SCHEME`` to
:data:`SCHEMES`, and its tests under ``tests/modelopt_fp8/schemes/``.
"""

from __future__ import annotations

from modelopt_fp8.schemes import fp8, fp8_pc_pt, unquantized
from modelopt_fp8.schemes.base import LinearScheme
from protocol.errors import VerificationError
from protocol.reasons import Reason

SCHEMES: tuple[LinearScheme, ...] = (fp8.SCHEME, fp8_pc_pt.SCHEME, unquantized.SCHEME)

_BY_NAME = {scheme.name: scheme for scheme in SCHEMES}
_BY_ALGO = {scheme.quant_algo: scheme for scheme in SCHEMES}
# The ModelOpt quant_algo values served, in the registry's order.
SERVED_ALGOS: tuple[str, ...] = tuple(algo for algo in _BY_ALGO if algo is not None)


def scheme_named(name: str) -> LinearScheme:
    """The scheme a manifest names; a name none answers to is refused, naming it."""
    scheme = _BY_NAME.get(name)
    if scheme is None:
        raise VerificationError(
            f"no quantization scheme is named {name!r} (known: {', '.join(_BY_NAME)})",
            reason=Reason.unsupported_layer,
            scheme=name,
        )
    return scheme


def scheme_serving(quant_algo: str | None) -> LinearScheme:
    """The scheme of a layer quantized with ``quant_algo`` (one of :data:`SERVED_ALGOS`), or of
    a layer the config excludes (``None``)."""
    return _BY_ALGO[quant_algo]


def demo_schemes() -> dict[str, LinearScheme]:
    """The schemes a demo checkpoint can be written in, by their demo names."""
    return {scheme.demo_name: scheme for scheme in SCHEMES if scheme.quant_algo is not None}


__all__ = [
    "SCHEMES",
    "SERVED_ALGOS",
    "LinearScheme",
    "demo_schemes",
    "scheme_named",
    "scheme_serving",
]
