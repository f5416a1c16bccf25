"""The front's parts on their own: who makes way at the cap, what a request may spend on
framing, and the share of requests each caller may have in hand."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.errors import ChunksTooSmallError, HeadersTooLargeError
from service.api.front.admission import Admission, Admitted, Idleness
from service.api.front.caller_shares import TOKEN_HOLDERS, CallerKey, CallerShares
from service.api.front.framing import FREE_CHUNKS, MAX_HEADER_LINES, MIN_CHUNK_BYTES, FramingBudget
from service.api.front.limits import PROBE_ROOM


@dataclass(eq=False)
class Connection:
    name: str
    waiting: bool = False
    closed: bool = False

    def make_way(self) -> None:
        self.closed = True

    def has_waiting_bytes(self) -> bool:
        return self.waiting


def test_the_longest_idle_makes_way_in_order_of_idleness() -> None:
    admission: Admission[Connection] = Admission(max_connections=3)
    between, unproven, lingering = Connection("b"), Connection("u"), Connection("l")
    admission.idle(between, Idleness.BETWEEN)
    admission.idle(unproven, Idleness.UNPROVEN)
    admission.idle(lingering, Idleness.LINGERING)
    order = []
    for i in range(3):
        assert admission.admit(Connection(f"new{i}"), 3) is Admitted.FULLY
        order += [
            c.name for c in (lingering, unproven, between) if c.closed and c.name not in order
        ]
    assert order == ["l", "u", "b"]


def test_a_connection_whose_request_waits_to_be_read_is_not_idle() -> None:
    admission: Admission[Connection] = Admission(max_connections=2)
    arrived, silent = Connection("arrived", waiting=True), Connection("silent")
    admission.idle(arrived, Idleness.UNPROVEN)
    admission.idle(silent, Idleness.UNPROVEN)
    assert admission.admit(Connection("new"), 2) is Admitted.FULLY
    assert silent.closed and not arrived.closed


def test_past_the_cap_with_none_idle_probes_have_room_then_none() -> None:
    admission: Admission[Connection] = Admission(max_connections=1)
    admitted = [admission.admit(Connection(str(i)), 1 + i) for i in range(PROBE_ROOM + 1)]
    assert admitted[:PROBE_ROOM] == [Admitted.PROBES_ONLY] * PROBE_ROOM
    assert admitted[PROBE_ROOM] is None
    # An idle probe-only connection making way leaves its place probe-only.
    idle_probe = next(iter(admission.probes_only))
    admission.idle(idle_probe, Idleness.BETWEEN)
    assert admission.admit(Connection("late"), 1 + PROBE_ROOM) is Admitted.PROBES_ONLY
    assert idle_probe.closed


def test_framing_is_paid_for_by_the_body() -> None:
    budget = FramingBudget(max_header_bytes=1024)
    for _ in range(FREE_CHUNKS):
        budget.arrived(6)
        budget.chunk()
        budget.body(1)
    assert budget.passed() is None
    budget.chunk()
    assert isinstance(budget.passed(), ChunksTooSmallError)
    budget.begin()
    for _ in range(4 * FREE_CHUNKS):  # chunks that carry their framing
        budget.arrived(MIN_CHUNK_BYTES + 8)
        budget.chunk()
        budget.body(MIN_CHUNK_BYTES)
    assert budget.passed() is None
    budget.begin()
    for _ in range(MAX_HEADER_LINES + 1):
        budget.line()
    assert isinstance(budget.passed(), HeadersTooLargeError)
    budget.begin()
    budget.arrived(2048)
    assert isinstance(budget.passed(), HeadersTooLargeError)


def test_each_caller_has_its_own_share() -> None:
    shares = CallerShares(per_caller=2)
    alice, bob = CallerKey(token=False, uid=1000), CallerKey(token=False, uid=1001)
    assert shares.take(alice) and shares.take(alice) and not shares.take(alice)
    assert shares.take(bob) and shares.take(TOKEN_HOLDERS)
    shares.give_back(alice)
    assert shares.held(alice) == 1 and shares.take(alice)
