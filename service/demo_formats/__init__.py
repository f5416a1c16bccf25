"""The formats a demo checkpoint can be written in, one module each behind one interface
(:class:`~service.demo_formats.base.DemoFormat`), found here by name.

The ModelOpt formats come from the daemon's scheme registry (``modelopt_fp8.schemes``: one
export per scheme it processes); the others are formats the daemon refuses and engines donate.
How to add one: write ``service/demo_formats/<format>.py`` with its ``FORMAT``, add it to
:data:`FORMATS`, and its name to ``weight_cache_cli/demo.py``'s choices (a test holds the two
equal).
"""

from __future__ import annotations

from modelopt_fp8.schemes import demo_schemes
from service.demo_formats import bf16, fp8_block
from service.demo_formats.base import DemoFormat
from service.demo_formats.modelopt import ModelOptFormat

FORMATS: dict[str, DemoFormat] = {
    **{name: ModelOptFormat(scheme) for name, scheme in demo_schemes().items()},
    fp8_block.FORMAT.name: fp8_block.FORMAT,
    bf16.FORMAT.name: bf16.FORMAT,
}

__all__ = ["FORMATS", "DemoFormat"]
