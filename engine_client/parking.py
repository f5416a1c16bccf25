"""A parked engine's side: park with the daemon and wait, holding nothing but the process and its
CUDA context, until the daemon releases it (an engine on the same model ended, or an operator
asked); then the load goes on and attaches.

The wait is a chain of long-polls (``GET /v1/parking/{id}?wait_s=``). A daemon that cannot be
reached is waited for; one that restarted meanwhile has forgotten the registration, so the
engine parks again with it. A park cancelled by an operator, or one that outlives
``park_timeout``, ends in :class:`~protocol.errors.ParkEndedError` with its reason
(``park_cancelled``, ``park_timeout``): the loader then falls back or fails, per ``fallback``.

vLLM asks the loader for its external weight memory just before it takes its memory snapshot,
which comes before the load: an engine parks there (so the snapshot is taken once the engine it
replaces has freed its memory), and the load that follows takes the outcome
(:func:`released_for_this_load`). Outside vLLM's GPU worker the load parks itself.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine_client.client import ApiCall, ClientConfig, DaemonClient
from engine_client.registrations import Registrations
from protocol.errors import (
    DaemonRestartedError,
    DaemonUnavailableError,
    ParkEndedError,
    ParkingNotFoundError,
    WeightCacheError,
)
from protocol.logsafe import get_logger
from protocol.reasons import Reason
from protocol.schemas.parking import MAX_WAIT_S, ParkedEngine, ParkRequest, ParkState

log = get_logger(__name__)

POLL_S = 30.0  # one long-poll; well under MAX_WAIT_S and the registration's grace
RETRY_S = 1.0  # between attempts to reach a daemon that does not answer


@dataclass(frozen=True)
class ParkingSpot:
    """What an engine parks as: the daemon's model, its rank, and its engine's group (shared
    by its TP ranks, which are released together)."""

    model: str
    tp_rank: int
    tp_size: int
    group: str
    if_serving: bool = False  # released at once when no engine holds a lease on the model


PARKING = Registrations("/v1/parking", ParkedEngine)


def _park(spot: ParkingSpot) -> ApiCall[ParkedEngine]:
    return PARKING.register(
        ParkRequest(
            model=spot.model,
            tp_rank=spot.tp_rank,
            tp_size=spot.tp_size,
            client_pid=os.getpid(),
            group=spot.group,
            if_serving=spot.if_serving,
        )
    )


class RegistrationWait:
    """One engine's registration with the daemon, followed until it is released or cancelled: a
    chain of long-polls. A daemon that cannot be reached is waited for; one that restarted (or
    expired the registration) forgot it, so it is made again through ``register``. Shared by
    parked engines and warm standbys (:mod:`engine_client.standby`)."""

    def __init__(
        self,
        client: DaemonClient,
        register: Callable[[], ParkedEngine],
        poll_s: float,
        entry: ParkedEngine | None = None,
    ) -> None:
        self.client = client
        self.register = register  # registers (every rank) and answers the one to follow
        self.poll_s = poll_s
        self.entry = entry  # the registration followed; None until made

    def until_settled(
        self, until: float | None = None, alive: Callable[[], bool] = lambda: True
    ) -> ParkedEngine | None:
        """The registration once released or cancelled; None if the monotonic time ``until``
        came, or ``alive`` turned false, first."""
        while alive():
            left = self.poll_s if until is None else until - time.monotonic()
            if left <= 0:
                return None
            try:
                if self.entry is None:
                    self.entry = self.register()
                else:
                    wait_s = min(self.poll_s, left, MAX_WAIT_S)
                    self.entry = self.client.send(PARKING.ask(self.entry.id, wait_s))
            except DaemonUnavailableError as exc:
                log.warning("weight-cache: waiting, daemon unreachable (%s); retrying", exc.detail)
                time.sleep(min(RETRY_S, max(0.0, left)))
                continue
            except (DaemonRestartedError, ParkingNotFoundError) as exc:
                log.warning("weight-cache: the daemon forgot this registration (%s)", exc.code)
                self.entry = None
                continue
            if self.entry.state is not ParkState.parked:
                return self.entry
        return None


def wait_until_released(
    config: ClientConfig,
    spot: Callable[[], ParkingSpot],
    timeout_s: float | None,
    poll_s: float = POLL_S,
) -> ParkedEngine:
    """Park (``spot()`` says as what; asked again for each daemon it parks with) and block until
    released; raises :class:`ParkEndedError` if cancelled or past ``timeout_s`` (None: wait for
    ever), and the daemon's refusal if it will not park this engine."""
    start = time.monotonic()
    deadline = None if timeout_s is None else start + timeout_s
    # Each long-poll may take its wait plus a request's own time.
    polling = dataclasses.replace(config, timeout_s=config.timeout_s + min(poll_s, MAX_WAIT_S))
    with DaemonClient(polling) as client:

        def park() -> ParkedEngine:
            parked = client.send(_park(spot()))
            log.info(
                "weight-cache: parked as %s (model %s, rank %d of %d, group %s): waiting "
                "to be released",
                parked.id,
                parked.model,
                parked.tp_rank,
                parked.tp_size,
                parked.group,
            )
            return parked

        waiting = RegistrationWait(client, park, poll_s)
        settled = waiting.until_settled(deadline)
        _give_up(client, waiting.entry)
        if settled is None:
            raise ParkEndedError(
                f"not released within park_timeout ({timeout_s} s)",
                reason=Reason.park_timeout.value,
            )
        if settled.state is ParkState.cancelled:
            raise ParkEndedError(
                "an operator cancelled this parked engine", reason=Reason.park_cancelled.value
            )
        log.info(
            "weight-cache: released after %.1f s (%s)",
            time.monotonic() - start,
            settled.cause.value if settled.cause else "?",
        )
        return settled


def _give_up(client: DaemonClient, parked: ParkedEngine | None) -> None:
    """Withdraw the registration (best effort: the daemon forgets it anyway, in a while)."""
    if parked is None:
        return
    try:
        client.send(PARKING.withdraw(parked.id))
    except WeightCacheError as exc:
        log.debug("withdrawing parked engine %s: %s", parked.id, exc)


# What this process's park came to, when it parked ahead of its load (vLLM's GPU worker asks
# for the external weight memory, where it parks, just before it loads the model).
_settled: list[ParkedEngine | WeightCacheError] = []
_settled_lock = threading.Lock()


def park_ahead(
    config: ClientConfig, spot: Callable[[], ParkingSpot], timeout_s: float | None
) -> WeightCacheError | None:
    """Park now and keep the outcome for the load that follows; the error, if it ended in one
    (the caller raises it at once when it must not fall back)."""
    try:
        outcome: ParkedEngine | WeightCacheError = wait_until_released(config, spot, timeout_s)
    except WeightCacheError as exc:
        outcome = exc
    with _settled_lock:
        _settled[:] = [outcome]
    return outcome if isinstance(outcome, WeightCacheError) else None


def released_for_this_load(
    config: ClientConfig, spot: Callable[[], ParkingSpot], timeout_s: float | None
) -> ParkedEngine:
    """The release this load waits for: the one this process parked for ahead of it, else
    park now."""
    with _settled_lock:
        outcome = _settled.pop() if _settled else None
    if outcome is None:
        return wait_until_released(config, spot, timeout_s)
    if isinstance(outcome, WeightCacheError):
        raise outcome
    return outcome
