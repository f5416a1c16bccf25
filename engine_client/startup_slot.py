"""An engine's GPU start-up slot: engines that share a GPU size their memory one at a time.

vLLM sizes an engine's KV cache from how the GPU's free memory changes while it profiles; an
engine starting beside it on the same GPU allocates meanwhile, that allocation is counted as
this engine's, and (as four engines started at once on one H200 showed) can leave it a negative
KV cache: "No available memory for the cache blocks". An engine takes its GPU's slot from the
daemon just before vLLM's memory snapshot and gives it back once its KV cache is allocated and
its graphs captured; the next engine waits meanwhile, for at most ``timeout_s``, then starts
without it, saying so.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import threading
import time

from engine_client.client import ApiCall, ClientConfig, DaemonClient
from engine_client.registrations import Registrations
from protocol.errors import DaemonUnavailableError, WeightCacheError
from protocol.logsafe import get_logger
from protocol.schemas.parking import MAX_WAIT_S
from protocol.schemas.startup_slots import SlotRequest, SlotState, SlotTicket

log = get_logger(__name__)

POLL_S = 30.0


SLOTS = Registrations("/v1/startup-slots", SlotTicket)


def _take(device: str, group: str, tp_rank: int, tp_size: int) -> ApiCall[SlotTicket]:
    return SLOTS.register(
        SlotRequest(
            device=device, tp_rank=tp_rank, tp_size=tp_size, client_pid=os.getpid(), group=group
        )
    )


class StartupSlot:
    """A held slot; :meth:`give_back` once (further calls, and process exit, do nothing more)."""

    def __init__(self, config: ClientConfig, ticket: SlotTicket) -> None:
        self.config = config
        self.ticket = ticket
        self.taken_at = time.monotonic()
        self._given_back = threading.Event()
        atexit.register(self.give_back, "the engine exited")

    def give_back(self, why: str = "its start-up allocations are done") -> None:
        if self._given_back.is_set():
            return
        self._given_back.set()
        try:
            with DaemonClient(self.config) as client:
                client.send(SLOTS.withdraw(self.ticket.id))
        except WeightCacheError as exc:  # a restarted daemon, a reclaimed slot: nothing held
            log.info("weight-cache: giving back the start-up slot: %s", exc.detail)
            return
        log.info(
            "weight-cache: gave back the start-up slot of %s after %.1f s (%s)",
            self.ticket.device,
            time.monotonic() - self.taken_at,
            why,
        )


def take_startup_slot(
    config: ClientConfig,
    device: str,
    group: str,
    tp_rank: int,
    tp_size: int,
    timeout_s: float,
    poll_s: float = POLL_S,
) -> StartupSlot | None:
    """Wait (at most ``timeout_s``) for ``device``'s start-up slot; None when the daemon is not
    there to ask or the wait ran out (the engine then starts without it, as before)."""
    start = time.monotonic()
    deadline = start + timeout_s
    polling = dataclasses.replace(config, timeout_s=config.timeout_s + min(poll_s, MAX_WAIT_S))
    announced = False
    with DaemonClient(polling) as client:
        try:
            ticket = client.send(_take(device, group, tp_rank, tp_size))
            while ticket.state is not SlotState.held:
                left = deadline - time.monotonic()
                if left <= 0:
                    client.send(SLOTS.withdraw(ticket.id))
                    log.warning(
                        "weight-cache: waited %.0f s for the start-up slot of %s (%d engine(s) "
                        "still ahead); starting without it: vLLM's profiling may count their "
                        "memory as this engine's",
                        timeout_s,
                        device,
                        ticket.ahead,
                    )
                    return None
                if not announced:
                    log.info(
                        "weight-cache: waiting for the start-up slot of %s: %d engine(s) ahead "
                        "size their memory on it first",
                        device,
                        ticket.ahead,
                    )
                    announced = True
                ticket = client.send(SLOTS.ask(ticket.id, min(poll_s, left, MAX_WAIT_S)))
        except DaemonUnavailableError as exc:
            log.info("weight-cache: no start-up slot (%s): starting without one", exc.detail)
            return None
        except WeightCacheError as exc:
            log.warning("weight-cache: no start-up slot (%s): starting without one", exc)
            return None
    log.info(
        "weight-cache: took the start-up slot of %s after %.1f s", device, time.monotonic() - start
    )
    return StartupSlot(config, ticket)
