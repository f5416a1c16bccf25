"""A warm standby: an engine started all the way before it is needed (attached to the daemon's
weights, compiled, CUDA graphs captured, KV cache sized), then put to sleep, holding little more
than its CUDA context and graphs, until the daemon releases it: when the engine serving its
model ends (its process gone, or its lease released), or when an operator asks. Then it wakes
(its KV cache allocated again at the same addresses) and serves.

``weight-cache standby -- vllm serve ...`` runs this beside the engine it starts:

1. wait until the engine answers ``/health`` (it has done all its start-up work);
2. find its leases (taken under this standby's group, ``WEIGHT_CACHE_STANDBY_GROUP``: they do not
   count as serving while it waits) and register every rank with the daemon as a standby of
   that model (``POST /v1/parking`` with ``standby``, ``if_serving``): when no engine serves the
   model, it is released at once and this engine simply serves;
3. otherwise sleep the engine (``POST /sleep``), noting the GPU memory it gave back;
4. long-poll until released; then wait until that memory is free on the GPU (a large engine
   that just died frees its memory a little after its end), wake the engine (``POST /wake_up``)
   and withdraw the registration. Cancelled by an operator: the engine is stopped.

A daemon that cannot be reached is waited for; one that restarted forgot the registration, so
the standby registers again (its leases were taken over by the new daemon, group and all).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from engine_client.client import ClientConfig, DaemonClient
from engine_client.engine_api import EngineApi
from engine_client.gpu_room import given_back, held_by, wait_for_room
from engine_client.parking import PARKING, RETRY_S, RegistrationWait
from protocol.errors import (
    DaemonUnavailableError,
    WeightCacheError,
)
from protocol.logsafe import get_logger
from protocol.schemas.leases import LeaseInfo
from protocol.schemas.parking import MAX_WAIT_S, ParkedEngine, ParkRequest, ParkState

log = get_logger(__name__)
T = TypeVar("T")

HEALTH_POLL_S = 0.02  # the proxy must not see it awake long before it sleeps
ASLEEP_LIMIT_BYTES = 2 << 30  # what a sleeping standby should hold at most, per GPU
# Level 1: vLLM gives the KV cache back and keeps (in host memory) what its weights pool holds,
# here only the runtime state: the weights are the daemon's, mapped, never vLLM's allocations.
SLEEP_LEVEL = 1


class Outcome(str, enum.Enum):
    serving = "serving"  # released, or nothing else served the model: the engine serves
    cancelled = "cancelled"  # an operator cancelled the standby: stop the engine
    engine_ended = "engine_ended"  # the engine exited first


@dataclass(frozen=True)
class StandbyOptions:
    engine_url: str
    group: str  # also in the engine's environment: its leases carry it
    model: str | None = None  # the daemon's model, where the engine holds no lease to tell it
    tp_size: int = 1  # likewise
    room_timeout_s: float = 30.0
    poll_s: float = 10.0  # one long-poll; the engine's end is noticed between polls


@dataclass(frozen=True)
class Engine:
    """What the standby knows of the engine process it watches."""

    alive: Callable[[], bool]
    pids: Callable[[], list[int]]  # the engine's processes (API server, EngineCore, workers)


@dataclass(frozen=True)
class Spot:
    model: str
    tp_size: int


def run_standby(config: ClientConfig, options: StandbyOptions, engine: Engine) -> Outcome:
    """Hold the engine as a warm standby until it serves, is cancelled, or ends."""
    api = EngineApi(options.engine_url)
    try:
        return _Standby(config, options, engine, api).run()
    finally:
        api.close()


class _Standby:
    def __init__(
        self, config: ClientConfig, options: StandbyOptions, engine: Engine, api: EngineApi
    ) -> None:
        self.options = options
        self.engine = engine
        self.api = api
        # Each long-poll may take its wait plus a request's own time.
        wait_s = min(options.poll_s, MAX_WAIT_S)
        self.client = DaemonClient(dataclasses.replace(config, timeout_s=config.timeout_s + wait_s))
        self.registered: list[ParkedEngine] = []

    def run(self) -> Outcome:
        with self.client:
            try:
                return self._run()
            finally:
                self._withdraw()

    def _run(self) -> Outcome:
        started = time.monotonic()
        if not self._wait_healthy():
            return Outcome.engine_ended
        log.info("weight-cache standby: engine up after %.1f s", time.monotonic() - started)
        spot = self._spot()
        if spot is None:
            return Outcome.serving
        state = self._register(spot)
        if state is ParkState.released:
            log.info("weight-cache standby: no engine serves %s: this one serves", spot.model)
            return Outcome.serving
        needed = self._sleep()
        ended = self._wait_released(spot)
        if ended is ParkState.cancelled:
            if not self.engine.alive():  # the daemon cancels a standby whose engine died
                return Outcome.engine_ended
            log.info("weight-cache standby: cancelled by an operator: stopping the engine")
            return Outcome.cancelled
        if ended is None:
            return Outcome.engine_ended
        self._wake(needed)
        return Outcome.serving

    # --- the steps ---------------------------------------------------------------------------

    def _wait_healthy(self) -> bool:
        """Wait (as long as the engine takes to start) until it answers ``/health``; False if
        it ended first."""
        while self.engine.alive():
            if self.api.healthy():
                return True
            time.sleep(HEALTH_POLL_S)
        return False

    def _spot(self) -> Spot | None:
        """The model and TP size the standby waits for: its engine's leases say (found by this
        standby's group), else the options; None: it cannot be a standby (it serves)."""
        leases = self._call(self.client.leases)
        mine = [x for x in leases if x.standby_group == self.options.group or self._ours(x)]
        if mine:
            return Spot(mine[0].model, mine[0].tp_size)
        if self.options.model is not None:
            log.warning(
                "weight-cache standby: the engine holds no lease of the daemon (it loaded its own "
                "weights: its log says why); it waits for %s all the same",
                self.options.model,
            )
            return Spot(self.options.model, self.options.tp_size)
        log.error(
            "weight-cache standby: the engine holds no lease of the daemon (it loaded its own "
            "weights: its log says why) and no --model was given: it serves instead of waiting"
        )
        return None

    def _ours(self, lease: LeaseInfo) -> bool:
        """A lease the engine's processes hold that was promoted already (a daemon restarted
        while the standby registered again after its release): still this engine's."""
        return lease.client_pid in set(self.engine.pids())

    def _register(self, spot: Spot) -> ParkState:
        return self._registered(spot).state

    def _registered(self, spot: Spot) -> ParkedEngine:
        """Every rank registered (again, for a daemon that forgot them); the last, to follow."""
        self.registered = []
        for rank in range(spot.tp_size):
            request = ParkRequest(
                model=spot.model,
                tp_rank=rank,
                tp_size=spot.tp_size,
                client_pid=os.getpid(),
                group=self.options.group,
                if_serving=True,
                standby=True,
            )
            self.registered.append(self._call(self._registration(request)))
        first = self.registered[0]
        log.info(
            "weight-cache standby: registered as %s (model %s, %d rank(s), group %s): %s",
            first.id,
            spot.model,
            spot.tp_size,
            self.options.group,
            self.registered[-1].state.value,
        )
        return self.registered[-1]

    def _registration(self, request: ParkRequest) -> Callable[[], ParkedEngine]:
        return lambda: self.client.send(PARKING.register(request))

    def _sleep(self) -> dict[str, int]:
        """Sleep the engine; the GPU bytes it gave back, per device (empty where unknown)."""
        before = held_by(self.engine.pids())
        start = time.monotonic()
        self.api.sleep(SLEEP_LEVEL)
        slept_s = time.monotonic() - start
        after = held_by(self.engine.pids())
        needed = given_back(before, after)
        log.info(
            "weight-cache standby: asleep (level %d) in %.2f s; GPU bytes held before %s, "
            "asleep %s",
            SLEEP_LEVEL,
            slept_s,
            before,
            after,
        )
        for uuid, held in (after or {}).items():
            if held > ASLEEP_LIMIT_BYTES and not needed.get(uuid):
                log.warning(
                    "weight-cache standby: the engine still holds %d bytes on %s asleep: start "
                    "it with --enable-sleep-mode",
                    held,
                    uuid,
                )
        return needed

    def _wait_released(self, spot: Spot) -> ParkState | None:
        """Long-poll until released or cancelled; None if the engine ended meanwhile."""
        waiting = RegistrationWait(
            self.client, lambda: self._registered(spot), self.options.poll_s, self.registered[-1]
        )
        settled = waiting.until_settled(alive=self.engine.alive)
        if settled is None:
            return None
        log.info(
            "weight-cache standby: %s (%s)",
            settled.state.value,
            settled.cause.value if settled.cause else "-",
        )
        return settled.state

    def _wake(self, needed: dict[str, int]) -> None:
        released = time.monotonic()
        waited = wait_for_room(needed, self.options.room_timeout_s)
        start = time.monotonic()
        self.api.wake_up()
        awake = time.monotonic()
        log.info(
            "weight-cache standby: awake: waited %.3f s for GPU memory, woke in %.3f s "
            "(%.3f s after the release)",
            waited,
            awake - start,
            awake - released,
        )

    # --- the daemon --------------------------------------------------------------------------

    def _call(self, send: Callable[[], T]) -> T:
        """``send`` until the daemon answers (waited for while unreachable)."""
        while True:
            try:
                return send()
            except DaemonUnavailableError as exc:
                if not self.engine.alive():
                    raise
                log.warning("weight-cache standby: daemon unreachable (%s); retrying", exc.detail)
                time.sleep(RETRY_S)

    def _withdraw(self) -> None:
        for entry in self.registered:
            try:
                self.client.send(PARKING.withdraw(entry.id))
            except WeightCacheError as exc:
                log.debug("withdrawing standby %s: %s", entry.id, exc)
        self.registered = []
