"""Text that always serialises: names from the filesystem, shown with their odd bytes escaped.

A file name is bytes; Python carries the bytes that are not UTF-8 as lone surrogates
(``surrogateescape``), which no JSON encoder writes, so an answer showing such a path could not
be serialised. Paths and details in answers go through :func:`printable`:
``ckpt-\\xff`` for the byte 0xff, readable, one line, and valid JSON.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator


def printable(value: str) -> str:
    """``value`` with the bytes a surrogate escape stands for written as ``\\xNN`` (and any
    other lone surrogate as ``\\uNNNN``); text without them is returned as it is."""
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        pass
    try:
        raw = value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    return raw.decode("utf-8", "backslashreplace")


def printable_tree(value: Any) -> Any:
    """``value`` with every string in it, through dicts, lists and tuples, made
    :func:`printable` (anything else is returned as it is)."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {str(k): printable_tree(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [printable_tree(v) for v in value]
    return value


# A str field whose value is made printable on the way in (paths, file names, details).
PrintableStr = Annotated[str, BeforeValidator(printable_tree)]
