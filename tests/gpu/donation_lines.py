"""What an engine on a checkpoint the daemon does not process says of its load, read from its
output: it donated (which model), attached to a donated model (which), or served its own load
(why). The patterns are made from the messages the loader logs (:mod:`engine_client.donations`,
:mod:`engine_client.fallback`), so the restart proof reads what the engine writes; and the
restart proof's judgement of one engine: the first ``weight_cache`` engine donates, every later
one attaches to that donation.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from engine_client.donations import ATTACHED_LOG, DONATED_LOG
from engine_client.fallback import FALLBACK_LOG, FALLING_BACK, OWN_LOAD


def _pattern(message: str, *groups: str) -> re.Pattern[str]:
    """``message`` (a %-format) as a regular expression, each ``%s``/``%d`` one of ``groups``."""
    pieces = re.split(r"%[sd]", message)
    assert len(pieces) == len(groups) + 1, message
    text = re.escape(pieces[0])
    for group, piece in zip(groups, pieces[1:], strict=True):
        text += f"({group})" + re.escape(piece)
    return re.compile(text)


DONATED = _pattern(DONATED_LOG, r"\S+", r"\d+")
ATTACHED = _pattern(ATTACHED_LOG, r"\S+", r"\d+")
OWN = _pattern(FALLBACK_LOG, "|".join(map(re.escape, (OWN_LOAD, FALLING_BACK))), r"\w+", ".*")


@dataclass(frozen=True)
class Outcome:
    """One engine's load of a donated checkpoint: ``way`` is ``donated``, ``attached``,
    ``own_load`` (it fell back: ``reason``, ``detail``) or ``unsaid`` (no such line)."""

    way: str
    model: str | None = None
    reason: str | None = None
    detail: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def outcome(lines: Iterable[str]) -> Outcome:
    """The first of the three messages in ``lines``."""
    for line in lines:
        if m := DONATED.search(line):
            return Outcome("donated", m.group(1))
        if m := ATTACHED.search(line):
            return Outcome("attached", m.group(1))
        if m := OWN.search(line):
            return Outcome("own_load", reason=m.group(2), detail=m.group(3)[:300])
    return Outcome("unsaid")


def judge(engine: str, found: Outcome, held: str | None) -> tuple[str, bool, object]:
    """The check of one ``weight_cache`` engine: with no donated model ``held`` by the daemon
    when it started, it must have donated; else it must have attached to ``held``. A fallback
    names its reason in the check itself."""
    if held is None:
        what, ok = (
            f"{engine}: donated the model (no donated model held at its start)",
            (found.way == "donated"),
        )
    else:
        what = f"{engine}: attached to the donated model {held}, not loading its own"
        ok = found.way == "attached" and found.model == held
    if found.way == "own_load":
        what += f" (it served its own load: {found.reason})"
    elif found.way == "unsaid":
        what += " (its output says neither donated nor attached)"
    elif not ok:
        what += f" (it {found.way} {found.model})"
    return what, ok, None if ok else found.as_dict()
