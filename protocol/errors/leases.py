"""Leases: unknown, ended, from an earlier run of the daemon, or over the caps."""

from __future__ import annotations

from protocol.errors.base import WeightCacheError
from protocol.errors.requests import NotFoundError


class LeaseNotFoundError(NotFoundError):
    code = "lease_not_found"
    title = "Unknown or ended lease"
    hint = "lease again"


class LeaseExpiredError(WeightCacheError):
    """The lease ended by expiring or because its client died; ``reason`` says which."""

    code = "lease_expired"
    status = 410
    title = "Lease expired"
    hint = "lease again, and renew within the TTL"


class DaemonRestartedError(WeightCacheError):
    code = "daemon_restarted"
    status = 409
    title = "Daemon restarted since the lease was granted"
    hint = "lease again"


class TooManyLeasesError(WeightCacheError):
    """The daemon's cap on active leases is reached; release or let leases expire first."""

    code = "too_many_leases"
    status = 429
    title = "Too many active leases"
    hint = "release leases or let them expire (--max-leases raises the cap)"


class TooManyClientLeasesError(TooManyLeasesError):
    code = "too_many_client_leases"
    title = "Too many active leases for this client process"
    hint = "release this process's leases (--max-leases-per-client raises the cap)"


class TooManyUserLeasesError(TooManyLeasesError):
    code = "too_many_user_leases"
    title = "Too many active leases for this user"
    hint = "release this user's leases (--max-leases-per-uid raises the cap)"
