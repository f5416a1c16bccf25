"""What a warm standby (``weight-cache standby``) says of itself, read from its stamped lines: the
messages of :mod:`engine_client.standby`, defined here once for the restart proof (and checked
against that module by ``tests/proof_tools/test_serve_tools.py``)."""

from __future__ import annotations

import re

from tests.gpu.processes import Line

SERVES = re.compile(r"weight-cache standby: no engine serves \S+: this one serves")
ASLEEP = re.compile(r"weight-cache standby: asleep \(level \d\) in ([\d.]+) s")
RELEASED = re.compile(r"weight-cache standby: released \((\w+)\)")
AWAKE = re.compile(
    r"weight-cache standby: awake: waited ([\d.]+) s for GPU memory, woke in ([\d.]+) s"
)
LOWERED = re.compile(r"--gpu-memory-utilization ([\d.]+) lowered to ([\d.]+)")


def first(lines: list[Line], pattern: re.Pattern[str]) -> tuple[Line, re.Match[str]] | None:
    for line in lines:
        if m := pattern.search(line.text):
            return line, m
    return None


def state(lines: list[Line]) -> str | None:
    """``serving`` (it served from the start, or woke), ``asleep``, else None (starting)."""
    if first(lines, SERVES) or first(lines, AWAKE):
        return "serving"
    if first(lines, ASLEEP):
        return "asleep"
    return None


def takeover(lines: list[Line]) -> dict[str, float | str]:
    """When (seconds after the standby's start) it was released and awake, and its wake."""
    figures: dict[str, float | str] = {}
    if found := first(lines, RELEASED):
        figures["released_at_s"] = found[0].t
        figures["cause"] = found[1].group(1)
    if found := first(lines, AWAKE):
        figures["awake_at_s"] = found[0].t
        figures["room_wait_s"] = float(found[1].group(1))
        figures["wake_s"] = float(found[1].group(2))
    if found := first(lines, ASLEEP):
        figures["sleep_s"] = float(found[1].group(1))
    if found := first(lines, LOWERED):
        figures["utilization_asked"] = float(found[1].group(1))
        figures["utilization_fitted"] = float(found[1].group(2))
    return figures
