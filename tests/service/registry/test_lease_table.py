"""Lease table rules: expiry, renewal, PID reaping with PID-reuse protection, ended leases."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from protocol.errors import DaemonRestartedError, LeaseExpiredError, LeaseNotFoundError
from service.registry.lease_holders import Holder
from service.registry.leases import Lease, LeaseEnd, LeaseTable
from tests.service.registry.processes import holder_of


def add(table: LeaseTable, pid: int, ttl_s: float, now: float, uid: int = 0) -> Lease:
    """A lease of model "m", rank 0 of 1, held by process ``pid`` of ``uid``."""
    holder = holder_of(pid, uid)
    return table.add("m", 0, 1, ttl_s=ttl_s, now=now, holder=holder)


def test_expiry_and_renewal() -> None:
    table = LeaseTable("b00t")
    lease = add(table, os.getpid(), ttl_s=10, now=100.0)
    assert lease.id.startswith("b00t.") and lease.holder.pid_start is not None
    assert table.sweep(105.0) == []
    table.renew(lease.id, None, now=105.0)
    assert lease.expires_at == 115.0 and lease.renewals == 1
    assert [(x.id, how) for x, how in table.sweep(115.5)] == [(lease.id, LeaseEnd.expired)]
    with pytest.raises(LeaseExpiredError):
        table.get(lease.id, now=116.0)


def test_renew_past_expiry_before_the_sweep_is_refused() -> None:
    table = LeaseTable("b00t")
    lease = add(table, os.getpid(), ttl_s=1, now=0.0)
    with pytest.raises(LeaseExpiredError):
        table.renew(lease.id, None, now=2.0)
    assert table.count() == 0


def test_reused_pid_does_not_keep_a_lease_alive() -> None:
    table = LeaseTable("b00t")
    lease = add(table, os.getpid(), ttl_s=100, now=0.0)
    start = lease.holder.pid_start
    assert start is not None
    # as if this PID now belonged to a younger process
    lease.holder = dataclasses.replace(lease.holder, pid_start=start - 1)
    assert [how for _, how in table.sweep(1.0)] == [LeaseEnd.reaped]


def test_zombie_client_is_reaped() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    table = LeaseTable("b00t")
    add(table, child.pid, ttl_s=100, now=0.0)
    # Wait for the exit without reaping it: the child stays a zombie, and kill(pid, 0) works.
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
    os.kill(child.pid, 0)
    assert [how for _, how in table.sweep(1.0)] == [LeaseEnd.reaped]
    child.wait()


def test_invisible_pid_relies_on_the_ttl() -> None:
    table = LeaseTable("b00t")
    lease = add(table, 2**31 - 2, ttl_s=10, now=0.0)
    assert lease.holder.pid_start is None  # not watched: no reaping by PID
    assert table.sweep(5.0) == []
    assert [how for _, how in table.sweep(11.0)] == [LeaseEnd.expired]


def test_unknown_released_and_foreign_leases() -> None:
    table = LeaseTable("b00t")
    lease = add(table, os.getpid(), ttl_s=10, now=0.0)
    table.end(lease.id, LeaseEnd.released)
    with pytest.raises(LeaseNotFoundError):
        table.get(lease.id, now=1.0)
    with pytest.raises(DaemonRestartedError):
        table.get("other.1234", now=1.0)


def test_counts_and_expiry_stay_exact_under_churn() -> None:
    table = LeaseTable("b00t")
    leases = [add(table, 4_000_000 + i % 3, ttl_s=10, now=0.0) for i in range(30)]
    assert table.count() == 30 and table.count("m") == 30 and table.count_client(4_000_000) == 10
    for step in range(1, 200):  # renewals leave stale heap entries behind
        table.renew(leases[0].id, None, now=step * 0.01)
    assert table.expire(10.5) and table.count() == 1  # only the renewed one is left
    assert table.count_client(4_000_000) == 1 and table.count_client(4_000_001) == 0
    assert [how for _, how in table.expire(100.0)] == [LeaseEnd.expired]
    assert table.count() == 0 and table.count("m") == 0 and table.watched() == []


def test_leases_are_counted_per_user_and_record_their_holder() -> None:
    table = LeaseTable("b00t")
    mine = add(table, os.getpid(), ttl_s=10, now=0.0, uid=1000)
    add(table, os.getpid(), ttl_s=10, now=0.0, uid=1000)
    theirs = add(table, 4_000_000, ttl_s=10, now=0.0, uid=1001)
    assert table.count_user(1000) == 2 and table.count_user(1001) == 1
    assert (mine.holder.uid, mine.holder.pid) == (1000, os.getpid())
    out_of_sight = Holder(uid=1002, pid=None, pid_start=None, named_pid=7)
    unwatched = table.add("m", 0, 1, ttl_s=10, now=0.0, holder=out_of_sight)
    assert (unwatched.holder.uid, unwatched.holder.pid, unwatched.client_pid) == (1002, None, 7)
    table.end(theirs.id, LeaseEnd.released)
    assert table.count_user(1001) == 0 and table.count_user(1000) == 2
