"""A safetensors header parsed entry by entry, with a bound on the entries.

``json.loads`` parses a whole document in one call that holds the GIL: a 63 MiB header of a
million empty entries stalled every other thread of the daemon (its event loop included) for
seconds and left a gigabyte behind. A header is one flat JSON object, so it is parsed one
top-level entry at a time with the standard library's own scanner (``json.decoder``, in C),
counting the entries as they come: other threads run between entries, and the parse stops at the
first entry past the bound, before it costs more. The bytes are decoded in 1 MiB pieces for the
same reason.
"""

from __future__ import annotations

import codecs
import json
import json.decoder
import re
from collections.abc import Callable, Iterator
from typing import Any

_PIECE = 1 << 20
_SPACE = re.compile(r"[ \t\n\r]*")
# The scanners json.loads itself uses (C where available); the stubs do not name them.
_SCANSTRING: Callable[[str, int], tuple[str, int]] = vars(json.decoder)["scanstring"]
_SCAN: Callable[[str, int], tuple[Any, int]] = vars(json.JSONDecoder())["scan_once"]


class HeaderJsonError(ValueError):
    """The header is not a flat JSON object of at most the allowed entries."""


def _text(raw: bytes) -> str:
    """``raw`` decoded as UTF-8, a piece at a time (no single call holds the GIL long)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    pieces = [decoder.decode(raw[i : i + _PIECE]) for i in range(0, len(raw), _PIECE)]
    pieces.append(decoder.decode(b"", final=True))
    return "".join(pieces)


def header_entries(raw: bytes, max_entries: int) -> Iterator[tuple[str, Any]]:
    """Every ``name: value`` of the JSON object in ``raw``, in order; raises
    :class:`HeaderJsonError` for anything else, or once ``max_entries`` is passed."""
    try:
        text = _text(raw)
    except UnicodeDecodeError as exc:
        raise HeaderJsonError(f"header is not UTF-8: {exc.reason}") from None
    at = _SPACE.match(text).end()  # type: ignore[union-attr]
    if text[at : at + 1] != "{":
        raise HeaderJsonError("header is not a JSON object")
    at = _SPACE.match(text, at + 1).end()  # type: ignore[union-attr]
    if text[at : at + 1] == "}":
        _expect_end(text, at + 1)
        return
    count = 0
    while True:
        if text[at : at + 1] != '"':
            raise HeaderJsonError(f"header JSON: a name expected at character {at}")
        try:
            name, at = _SCANSTRING(text, at + 1)
            at = _SPACE.match(text, at).end()  # type: ignore[union-attr]
            if text[at : at + 1] != ":":
                raise HeaderJsonError(f"header JSON: ':' expected at character {at}")
            at = _SPACE.match(text, at + 1).end()  # type: ignore[union-attr]
            value, at = _SCAN(text, at)
        except (ValueError, StopIteration, RecursionError) as exc:
            if isinstance(exc, HeaderJsonError):
                raise
            raise HeaderJsonError(f"header is not valid JSON: {type(exc).__name__}") from None
        count += 1
        if count > max_entries:
            raise HeaderJsonError(f"header lists more than {max_entries} entries")
        yield name, value
        at = _SPACE.match(text, at).end()  # type: ignore[union-attr]
        separator = text[at : at + 1]
        if separator == "}":
            _expect_end(text, at + 1)
            return
        if separator != ",":
            raise HeaderJsonError(f"header JSON: ',' or '}}' expected at character {at}")
        at = _SPACE.match(text, at + 1).end()  # type: ignore[union-attr]


def _expect_end(text: str, at: int) -> None:
    # safetensors pads a header with spaces to align the data; anything else is not a header.
    if text[at:].strip(" \t\n\r"):
        raise HeaderJsonError("header JSON has data after its object")
