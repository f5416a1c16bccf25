"""Prometheus metrics, one registry per daemon (so several daemons can live in one test process).

Counters and histograms are updated where things happen; gauges of state (models, bytes,
active leases) are read at scrape time from a :class:`StateSnapshot` the daemon hands over, so
they can never drift from it (and this module needs nothing of the daemon).

Names follow Prometheus's conventions: the unit last (``_bytes``, ``_seconds``; ``_duration``
for a time taken), ``_total`` on counters, no ``_created`` series (a restarted daemon's counters
start at 0, which ``rate()`` already handles), and ``weight_cache_build_info`` at 1 with the
versions as labels.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


@dataclass(frozen=True)
class StateSnapshot:
    """The daemon's state the gauges show, taken under its lock at scrape time."""

    models_by_state: dict[str, int] = field(default_factory=dict)
    bytes_resident: dict[str, int] = field(default_factory=dict)
    leases_active: int = 0
    parked: int = 0  # ranks of parked engines still waiting
    startup_slots: dict[str, int] = field(default_factory=dict)  # tickets by state
    # Of the models above, those engines donated: by state (loading: offered, not committed),
    # and the arena bytes the ready ones hold.
    donated_by_state: dict[str, int] = field(default_factory=dict)
    donated_bytes_resident: int = 0


class _StateCollector(Collector):
    def __init__(self, snapshot: Callable[[], StateSnapshot]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily]:
        models = GaugeMetricFamily("weight_cache_models", "Models by state", labels=["state"])
        resident = GaugeMetricFamily(
            "weight_cache_resident_bytes", "Arena bytes held, by model", labels=["model"]
        )
        leases = GaugeMetricFamily("weight_cache_leases_active", "Active leases")
        parked = GaugeMetricFamily(
            "weight_cache_parked_engines", "Ranks of parked engines waiting to be released"
        )
        slots = GaugeMetricFamily(
            "weight_cache_startup_slot_tickets", "Start-up slot tickets by state", labels=["state"]
        )
        donated = GaugeMetricFamily(
            "weight_cache_donated_models",
            "Models engines donated, by state (loading: offered, not committed yet)",
            labels=["state"],
        )
        donated_resident = GaugeMetricFamily(
            "weight_cache_donated_resident_bytes", "Arena bytes held by donated models"
        )
        state = self.snapshot()
        for name, n in state.donated_by_state.items():
            donated.add_metric([name], n)
        donated_resident.add_metric([], state.donated_bytes_resident)
        parked.add_metric([], state.parked)
        for name, n in state.startup_slots.items():
            slots.add_metric([name], n)
        for model, nbytes in state.bytes_resident.items():
            resident.add_metric([model], nbytes)
        for name, n in state.models_by_state.items():
            models.add_metric([name], n)
        leases.add_metric([], state.leases_active)
        yield models
        yield resident
        yield leases
        yield parked
        yield slots
        yield donated
        yield donated_resident


class Metrics:
    def __init__(self, snapshot: Callable[[], StateSnapshot], versions: dict[str, str]) -> None:
        disable_created_metrics()  # type: ignore[no-untyped-call]  # process-wide
        self.registry = CollectorRegistry()
        r = self.registry
        Info("weight_cache_build", "Versions of this daemon", registry=r).info(
            {**versions, "python": platform.python_version()}
        )
        # via: request (granted by this daemon) or keeper (taken over from the keeper at
        # start), so that granted less ended is what is active.
        self.leases_granted = Counter(
            "weight_cache_leases_granted", "Leases granted, by how", ["via"], registry=r
        )
        self.leases_released = Counter(
            "weight_cache_leases_released", "Leases released", registry=r
        )
        self.leases_expired = Counter(
            "weight_cache_leases_expired", "Leases ended by their TTL", registry=r
        )
        self.leases_reaped = Counter(
            "weight_cache_leases_reaped",
            "Leases ended because their client process died",
            registry=r,
        )
        self.refusals = Counter(
            "weight_cache_refusals", "Requests refused, by error code", ["code"], registry=r
        )
        self.lease_seconds = Histogram(
            "weight_cache_lease_grant_duration_seconds",
            "Time to grant a lease, manifest included",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0),
            registry=r,
        )
        self.load_seconds = Histogram(
            "weight_cache_load_duration_seconds",
            "Time to load and process a model",
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
            registry=r,
        )
        self.arena_corruptions = Counter(
            "weight_cache_arena_corruptions",
            "Models failed because a scrub found their resident bytes changed",
            ["model"],
            registry=r,
        )
        self.scrubs = Counter(
            "weight_cache_scrubs", "Completed scrubs of every resident arena", registry=r
        )
        self.parked_releases = Counter(
            "weight_cache_parked_releases",
            "Parked engines released, by cause (reaped, lease_ended, operator)",
            ["cause"],
            registry=r,
        )
        self.startup_slot_reclaims = Counter(
            "weight_cache_startup_slot_reclaims",
            "Start-up slots taken back from their engine (engine_gone, hold_expired)",
            ["why"],
            registry=r,
        )
        # Donations (service/registry/donations.py): every offer ends committed, refused at its
        # commit, or abandoned (by its donor, its donor gone, or unloaded before its commit).
        self.donations_offered = Counter(
            "weight_cache_donations_offered", "Donations offered an arena", registry=r
        )
        self.donations_committed = Counter(
            "weight_cache_donations_committed", "Donations committed (ready models)", registry=r
        )
        self.donations_refused = Counter(
            "weight_cache_donations_refused",
            "Donation offers and commits refused, by error code",
            ["code"],
            registry=r,
        )
        self.donations_abandoned = Counter(
            "weight_cache_donations_abandoned",
            "Pending donations dropped, by why (donor, donor_gone, unloaded)",
            ["why"],
            registry=r,
        )
        self.evictions = Counter(
            "weight_cache_evictions",
            "Models evicted to make room, by pressure (memory_budget, max_models, free_memory)",
            ["pressure"],
            registry=r,
        )
        r.register(_StateCollector(snapshot))
