"""Hostile peers of the handle socket: a member of its group trickling bytes into many
connections while the rightful lease holder asks for its descriptor."""

from __future__ import annotations

from pathlib import Path

from bench.hostile_tools import Result, Target
from harness.hostile.handle_holder import holder_under_trickle


def trickled(target: Target, work: Path) -> Result:
    """70 connections of a member of the socket's group each send one byte every 4 s, made
    again when closed, for 20 s (the probe's kept the holder out, ECONNRESET, for 40 s); the
    lease's holder asks for its descriptor every 0.1 s meanwhile: held counts the answers."""
    seen = holder_under_trickle(target.url, "qwen", connections=70, seconds=20.0, every_s=4.0)
    how = f"answered, slowest {seen.slowest_s * 1e3:.0f} ms; attacker {seen.attacker}" + (
        f"; errors {sorted(seen.errors)[:2]}" if seen.errors else ""
    )
    return seen.asked, seen.answered, how
