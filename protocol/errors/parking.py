"""Parked engines and start-up slots: unknown registrations, the caps, nothing to release, and a
park that ended without a release."""

from __future__ import annotations

from protocol.errors.base import CarriesReason, WeightCacheError
from protocol.errors.models import ConflictError
from protocol.errors.requests import NotFoundError
from protocol.reasons import Reason


class ParkingNotFoundError(NotFoundError):
    code = "parking_not_found"
    title = "Unknown or forgotten parked engine"
    hint = (
        "list parked engines with GET /v1/parking (`weight-cache parking`); an engine not asked "
        "for within its expiry is forgotten"
    )


class TooManyParkedError(WeightCacheError):
    """The daemon's cap on parked engines (or start-up slot tickets) is reached."""

    code = "too_many_parked"
    status = 429
    title = "Too many parked engines"
    hint = "release or cancel parked engines (--max-parked raises the cap)"


class TooManyClientParkedError(TooManyParkedError):
    code = "too_many_client_parked"
    title = "Too many parked engines for this client process"
    hint = "this process has parked its ranks already (--max-parked-per-client raises the cap)"


class TooManyUserParkedError(TooManyParkedError):
    code = "too_many_user_parked"
    title = "Too many parked engines for this user"
    hint = (
        "this user's engines hold their share of the parked engines and start-up slot tickets "
        "(--max-parked-per-uid raises it)"
    )


class NothingParkedError(ConflictError):
    """A release asked for a model none of whose engines is parked in full (every TP rank)."""

    code = "nothing_parked"
    title = "No parked engine to release"
    hint = (
        "park an engine (loader option `park`) with every TP rank first; GET /v1/parking lists them"
    )


class StartupSlotNotFoundError(NotFoundError):
    code = "startup_slot_not_found"
    title = "Unknown or reclaimed start-up slot ticket"
    hint = (
        "ask for the slot again; a ticket not asked for within its expiry, or held past "
        "--startup-slot-hold, is given up"
    )


class ParkEndedError(CarriesReason):
    """A parked engine was not released: cancelled, or its ``park_timeout`` passed; ``reason``
    (a :class:`~protocol.reasons.Reason`) says which. Raised on the engine side only."""

    code = "park_ended"
    status = 409
    title = "The parked engine was not released"
    hint = (
        "the engine falls back or fails (its `fallback` option); `reason` says whether it was "
        "cancelled or waited past `park_timeout`"
    )
    default_reason = Reason.park_cancelled


class StandbyEngineError(WeightCacheError):
    """A warm standby's engine did not answer its sleep endpoints as asked (it is not started
    with ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``, or it failed); raised by
    ``weight-cache standby`` only, which then cannot hold the engine asleep or wake it."""

    code = "standby_engine_failed"
    status = 502
    title = "The standby's engine did not sleep or wake"
    hint = (
        "start the engine with `--enable-sleep-mode` (GPU only) under `weight-cache standby`, "
        "which sets VLLM_SERVER_DEV_MODE=1; the engine's log says why it refused"
    )
