"""The engine side: reaching the daemon, verifying its grant, and using the lease. Each of
these ends in one fallback :class:`~protocol.reasons.Reason`."""

from __future__ import annotations

from protocol.client_settings import client_setting
from protocol.errors.base import CarriesReason, WeightCacheError
from protocol.reasons import Reason

_URL, _UDS, _HOST, _PORT = map(client_setting, ("url", "uds", "host", "port"))


class DaemonUnavailableError(WeightCacheError):
    code = "daemon_unavailable"
    status = 503
    title = "Daemon not reachable"
    hint = "start the daemon, or point the loader's `url` / `uds` at it"
    cli_hint = (
        f"start it (`weight-cache serve`), or point {_URL.flag} / {_UDS.flag} (or "
        f"{', '.join(s.variable for s in (_URL, _HOST, _PORT, _UDS))}) at it"
    )


class VerificationError(CarriesReason):
    """The lease does not describe what this engine would have built; ``reason`` says which
    check failed."""

    code = "verification_failed"
    status = 409
    title = "Lease failed verification"
    hint = "the engine falls back to an ordinary load; `reason` says why"
    default_reason = Reason.manifest_invalid


class AttachError(CarriesReason):
    """Attaching failed after the daemon answered (its answer, the arena, the views, binding);
    ``reason`` says at which step. Raised on the engine side only, where the foreign exception
    arose."""

    code = "attach_failed"
    status = 500
    title = "Attaching to the leased weights failed"
    hint = "the engine falls back to an ordinary load; `reason` says at which step"


class BadResponseError(AttachError):
    code = "bad_response"
    status = 502
    title = "The daemon's answer is not the API's JSON"
    hint = "check that the loader's `url` / `uds` points at the weight-cache daemon"


class ArenaUnavailableError(AttachError):
    code = "arena_unavailable"
    status = 503
    title = "The leased arena cannot be opened"
    hint = (
        "share the daemon's run directory with the engine (/run/weight-cache in compose), or set "
        "the loader's handle_socket; the engine falls back meanwhile"
    )


class IpcOpenError(ArenaUnavailableError):
    code = "ipc_open_failed"
    title = "CUDA refused the leased IPC handle or descriptor"
    hint = (
        "run the engine on the daemon's GPU with cuda-bindings installed (with --cuda-handles "
        "ipc, also in the daemon's PID and IPC namespaces)"
    )


class HandleRefusedError(ArenaUnavailableError):
    """The daemon's handle socket would not pass a descriptor: not the lease's holder (peer
    credentials or secret), or no such live lease; ``why`` says which."""

    code = "handle_refused"
    status = 403
    title = "The handle socket refused the request"
    hint = (
        "ask for the descriptor from the process that holds the lease, with the lease's secret, "
        "as the same user as the daemon (or root)"
    )
