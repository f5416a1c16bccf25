"""Runs at the start of every Python process the vLLM tests start (this directory is on their
``PYTHONPATH``): the host CPU answers as a plain AVX2 machine (``tests/vllm/cpu_capabilities.py``)
before torch or vLLM is imported. Then the ``sitecustomize`` this one hides, if any, runs."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parents[2]  # the checkout, whose ``tests`` package the tests import
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from tests.vllm.cpu_capabilities import install  # noqa: E402

install(at_interpreter_start=True)

_entries = [Path(p).resolve() if p else None for p in sys.path]
_after = sys.path[_entries.index(_HERE) + 1 :] if _HERE in _entries else []
_hidden = importlib.machinery.PathFinder.find_spec("sitecustomize", _after)
if _hidden is not None and _hidden.loader is not None:
    _hidden.loader.exec_module(importlib.util.module_from_spec(_hidden))
