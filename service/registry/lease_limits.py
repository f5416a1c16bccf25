"""How long a lease may last and how many may be held: a client cannot pin memory forever or
exhaust the lease table, one user cannot take more than its share (``max_leases_per_uid``, a
quarter of the table by default), and one process not every lease of its user."""

from __future__ import annotations

from protocol.errors import (
    InvalidRequestError,
    TooManyClientLeasesError,
    TooManyLeasesError,
    TooManyUserLeasesError,
)
from service.registry.lease_holders import Holder
from service.registry.leases import LeaseTable
from service.settings import DaemonSettings


class LeaseLimits:
    """The TTL and count limits of the daemon's settings (read at each call: they may change)."""

    def __init__(self, settings: DaemonSettings) -> None:
        self.settings = settings

    def ttl_for(self, asked_s: float | None) -> float:
        """The TTL a grant gets: the asked one, else the default; above the maximum is refused."""
        return self.checked_ttl(asked_s or self.settings.default_ttl_s)

    def checked_ttl(self, ttl_s: float) -> float:
        if ttl_s > self.settings.max_ttl_s:
            detail = (
                f"ttl_s {ttl_s} exceeds this daemon's maximum of {self.settings.max_ttl_s} s "
                "(--max-ttl); ask for less, and renew"
            )
            raise InvalidRequestError.of_field(
                "ttl_s", detail, "less_than_equal", limit=self.settings.max_ttl_s
            )
        return ttl_s

    def check_room(self, leases: LeaseTable, holder: Holder) -> None:
        """Refuse one more lease past the daemon's cap, the holder user's or its process's
        (expired ones freed first). Caller holds the daemon's lock."""
        leases.expire(leases.now())
        s, uid, pid = self.settings, holder.uid, holder.pid
        _refuse_at(s.max_leases, leases.count(), "the daemon", TooManyLeasesError)
        if uid is not None:
            held = leases.count_user(uid)
            _refuse_at(s.max_leases_per_uid, held, f"uid {uid}", TooManyUserLeasesError, uid=uid)
        if pid is not None:
            held, who = leases.count_client(pid), f"client process {pid}"
            _refuse_at(s.max_leases_per_client, held, who, TooManyClientLeasesError, client_pid=pid)


def _refuse_at(
    cap: int, held: int, who: str, error: type[TooManyLeasesError], **fields: int
) -> None:
    """Refuse one more lease for ``who`` (the daemon, a user, a process) holding ``held`` of
    its ``cap``."""
    if held >= cap:
        raise error(f"{who} holds its maximum of {cap} active leases", limit=cap, **fields)
