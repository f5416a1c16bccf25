"""Who holds a lease (or a parked engine, or a start-up slot): the process the kernel proved, or
for a token holder whose process the daemon cannot see (an engine in another container over
TCP), nobody's process: its TTL ends it."""

from __future__ import annotations

import os

import pytest

from protocol.errors import ClientNotVisibleError
from service.registry.lease_holders import Caller, prove_holder

OUT_OF_SIGHT = 4_000_000  # above pid_max's default: no process of this namespace


def test_a_visible_process_is_watched() -> None:
    holder = prove_holder(Caller(uid=os.geteuid(), pid=None), os.getpid())
    assert (holder.uid, holder.pid) == (os.geteuid(), os.getpid()) and holder.watched


def test_a_process_out_of_sight_is_refused_without_the_token() -> None:
    with pytest.raises(ClientNotVisibleError):
        prove_holder(Caller(uid=os.geteuid(), pid=None), OUT_OF_SIGHT)


def test_a_token_holders_process_out_of_sight_holds_by_its_ttl() -> None:
    holder = prove_holder(Caller(uid=None, pid=None, token=True), OUT_OF_SIGHT)
    assert (holder.uid, holder.pid, holder.watched) == (None, None, False)


def test_a_remote_token_holders_pid_names_nothing_here() -> None:
    """A peer from another network namespace (uid unknown) names a pid of its own namespace:
    even where a process here has that number (this one), nothing is watched for it."""
    remote = Caller(uid=None, pid=None, token=True, via="tcp")
    holder = prove_holder(remote, os.getpid())
    assert (holder.uid, holder.pid, holder.watched) == (None, None, False)
