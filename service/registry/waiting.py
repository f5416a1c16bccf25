"""Engines that wait on the daemon: parked ones (``parking.py``) and those queued for their GPU's
start-up slot (``startup_slots.py``), built and swept together so the daemon wires them once."""

from __future__ import annotations

import threading
from collections.abc import Callable

from service.metrics import Metrics
from service.registry.parking import ParkingLot
from service.registry.startup_slots import StartupSlots
from service.registry.waiting_rules import WaitingCaps
from service.settings import DaemonSettings


class WaitingEngines:
    def __init__(
        self,
        boot_id: str,
        lock: threading.RLock,
        settings: DaemonSettings,
        metrics: Metrics,
        known_model: Callable[[str], object],
        serving: Callable[[str], bool],
        promote: Callable[[str, int | None], object],
    ) -> None:
        caps = WaitingCaps(
            settings.max_parked, settings.max_parked_per_uid, settings.max_parked_per_client
        )
        self.parking = ParkingLot(
            boot_id,
            lock,
            caps,
            on_release=lambda cause: metrics.parked_releases.labels(cause=cause.value).inc(),
            known_model=known_model,
            serving=serving,
            promote=promote,
        )
        self.startup_slots = StartupSlots(
            boot_id,
            lock,
            caps,
            settings.startup_slot_hold_s,
            on_reclaim=lambda why: metrics.startup_slot_reclaims.labels(why=why).inc(),
        )

    def notify(self, callback: Callable[[str], None]) -> None:
        """Call ``callback`` (from any thread, under the lock) with the id of every parked
        engine or start-up slot ticket whose state changed."""
        self.parking.on_change = callback
        self.startup_slots.on_change = callback

    def expire(self, now: float) -> None:
        self.parking.expire(now)
        self.startup_slots.expire(now)

    def watched(self) -> set[tuple[int, int]]:
        """(PID, start) of every process whose end matters to a waiting engine."""
        return {*self.parking.watched(), *self.startup_slots.watched()}

    def process_gone(self, pid: int, start: int, now: float) -> None:
        self.parking.process_gone(pid, start, now)
        self.startup_slots.process_gone(pid, start, now)
