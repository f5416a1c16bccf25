"""Who may call, and whose leases: a caller the daemon does not trust, a lease for a process it
cannot see or that is not the caller's, another user's lease."""

from __future__ import annotations

from protocol.errors.base import WeightCacheError


class ForbiddenError(WeightCacheError):
    code = "forbidden"
    status = 403
    title = "Forbidden"
    hint = "ask the daemon's operator"


class PeerNotAllowedError(ForbiddenError):
    """Without a token, a loopback TCP peer of another user than the daemon's (and not root)."""

    code = "peer_not_allowed"
    title = "Local user not allowed without the token"
    hint = (
        "use the daemon's Unix socket (--uds; --socket-group opens it to a group), or send the "
        "daemon's token (--token-file); --trust-local-users opens loopback TCP to all"
    )


class ClientNotVisibleError(ForbiddenError):
    """A lease for a process the daemon cannot see (so could never reap)."""

    code = "client_not_visible"
    title = "Client process not visible to the daemon"
    hint = (
        "lease over the daemon's Unix socket (--uds), which proves who you are, or run the "
        "engine in the daemon's PID namespace"
    )


class ClientNotYoursError(ForbiddenError):
    """A lease for a process of another user than the caller's."""

    code = "client_not_yours"
    title = "Client process belongs to another user"
    hint = "send your own process id as client_pid"


class RegistrationNotYoursError(ForbiddenError):
    """A parked engine or a start-up slot ticket registered by another user."""

    code = "registration_not_yours"
    title = "Parked engine or start-up slot held by another user"
    hint = (
        "only the user that parked an engine or asked for a slot (or a token holder) may read, "
        "release, cancel or withdraw it"
    )


class LeaseNotYoursError(ForbiddenError):
    code = "lease_not_yours"
    title = "Lease held by another user"
    hint = "only the user that took a lease (or a token holder) may read, renew or release it"
