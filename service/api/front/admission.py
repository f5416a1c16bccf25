"""Who gets a connection when the daemon has ``max_connections`` open.

An idle connection (no request in the daemon's hands) makes way for the new one, as nginx reuses
idle keep-alive connections when it runs out, the longest idle first in this order: one whose
request was refused and whose last bytes are being dropped; one that has not finished a request
(it sent nothing, or part of one); a keep-alive one between requests. An answered client is the
last to lose its connection, because closing one between requests can race a request it is
sending, while a connection that never finished a request loses nothing. A connection whose
client's bytes wait to be read is not idle (its request came, as the newcomer did), however
long ago it was made; ``SCAN`` of each kind are looked at, at most. When none is idle,
``PROBE_ROOM`` more connections are let in for ``/health`` and ``/ready`` alone (the rest of
what they ask is answered 503), so a probe has room while those are not all taken (a client
keeping more connections busy than the cap, with probes of its own, can take them); past those,
a new connection is answered 503 at once.
"""

from __future__ import annotations

import enum
from typing import Generic, Protocol, TypeVar

from service.api.front.limits import PROBE_ROOM


class Idleness(enum.IntEnum):
    """Why a connection is idle; lower makes way first."""

    LINGERING = 0  # its request was refused or answered early: its last bytes are dropped
    UNPROVEN = 1  # it has not finished a request: it sent nothing, or part of one
    BETWEEN = 2  # keep-alive, between requests


class Admitted(enum.Enum):
    FULLY = "fully"
    PROBES_ONLY = "probes only"  # past the cap: /health and /ready alone


SCAN = 16  # idle connections of a kind looked at for one newcomer


class Yields(Protocol):
    def make_way(self) -> None:
        """Close for a newcomer (it was idle)."""

    def has_waiting_bytes(self) -> bool:
        """Whether its client's bytes wait to be read (then it is not idle)."""


C = TypeVar("C", bound=Yields)


class Admission(Generic[C]):
    def __init__(self, max_connections: int) -> None:
        self.max_connections = max_connections
        self._idle: dict[Idleness, dict[C, None]] = {idleness: {} for idleness in Idleness}
        self._where: dict[C, Idleness] = {}
        self.probes_only: set[C] = set()

    def admit(self, newcomer: C, open_connections: int) -> Admitted | None:
        """How ``newcomer`` is let in, with ``open_connections`` open already (an idle one may
        be closed for it); None: turned away."""
        if open_connections < self.max_connections:
            return Admitted.FULLY
        victim = self.longest_idle()
        if victim is not None:  # the newcomer takes its place, probes only if it was
            admitted = Admitted.PROBES_ONLY if victim in self.probes_only else Admitted.FULLY
            self.forget(victim)
            victim.make_way()
            if admitted is Admitted.PROBES_ONLY:
                self.probes_only.add(newcomer)
            return admitted
        if len(self.probes_only) < PROBE_ROOM:
            self.probes_only.add(newcomer)
            return Admitted.PROBES_ONLY
        return None

    def longest_idle(self) -> C | None:
        for idleness in Idleness:
            for n, connection in enumerate(self._idle[idleness]):
                if n == SCAN:
                    break
                if idleness is Idleness.LINGERING or not connection.has_waiting_bytes():
                    return connection
        return None

    def idle(self, connection: C, idleness: Idleness) -> None:
        """``connection`` is idle since now (the last of its kind to make way)."""
        self.busy(connection)
        self._idle[idleness][connection] = None
        self._where[connection] = idleness

    def busy(self, connection: C) -> None:
        """``connection`` has a request in the daemon's hands."""
        where = self._where.pop(connection, None)
        if where is not None:
            del self._idle[where][connection]

    def forget(self, connection: C) -> None:
        """``connection`` is closed."""
        self.busy(connection)
        self.probes_only.discard(connection)
