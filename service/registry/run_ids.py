"""Ids of what one run of the daemon hands out (leases, parked engines, start-up slot
tickets): the run's boot id, then a random part, so that an id from an earlier run is told
apart from one this run forgot (``daemon_restarted`` rather than not found)."""

from __future__ import annotations

import secrets


def new_id(boot_id: str) -> str:
    return f"{boot_id}.{secrets.token_hex(12)}"


def from_this_run(some_id: str, boot_id: str) -> bool:
    return some_id.startswith(f"{boot_id}.")
