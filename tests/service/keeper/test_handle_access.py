"""Who may have a lease's descriptors: the secret, the user, the process (in this namespace or
a nested one), decided in one function."""

from __future__ import annotations

import os
import time

from service.registry.handle_access import Peer, holder_refusal, pids_of
from service.registry.lease_holders import Holder, trusted_uids
from service.registry.leases import LeaseTable

UIDS = frozenset({1000, 0})


def lease(pid: int, uid: int | None = None):
    holder = Holder(uid=uid, pid=pid, pid_start=None, named_pid=pid)
    return LeaseTable("b00t").add("m", 0, 1, 60.0, time.time(), holder)


def test_the_holder_with_the_secret_may() -> None:
    held = lease(4242)
    assert holder_refusal(held, held.secret, Peer(4242, 1000, 1000), UIDS) is None
    assert holder_refusal(held, held.secret, Peer(0, 0, 0), UIDS) is None  # unseen pid: not checked


def test_anyone_else_may_not() -> None:
    held = lease(4242)
    assert "secret" in str(holder_refusal(held, "guess", Peer(4242, 1000, 1000), UIDS))
    assert "uid 1001" in str(holder_refusal(held, held.secret, Peer(4242, 1001, 1001), UIDS))
    assert "uid 1002" in str(holder_refusal(held, held.secret, Peer(4242, 1002, 1002), UIDS))
    assert "not the lease's holder" in str(
        holder_refusal(held, held.secret, Peer(4243, 1000, 1000), UIDS)
    )


def test_the_holders_own_user_may() -> None:
    """A user the daemon does not trust holds its own lease (its uid proven at the grant)."""
    held = lease(4242, uid=1002)
    assert holder_refusal(held, held.secret, Peer(4242, 1002, 1002), UIDS) is None
    assert "uid 1003" in str(holder_refusal(held, held.secret, Peer(4242, 1003, 1003), UIDS))


def test_a_process_is_known_by_its_pid_in_every_namespace() -> None:
    assert os.getpid() in pids_of(os.getpid())
    assert pids_of(2**22 + 7) == {2**22 + 7}  # no such process: only what was given
    mine = lease(os.getpid())
    assert (
        holder_refusal(mine, mine.secret, Peer(os.getpid(), os.geteuid(), 0), trusted_uids())
        is None
    )


def test_secrets_are_per_lease_and_adoption_keeps_id_and_secret() -> None:
    table = LeaseTable("new")
    a, b = lease(1), lease(1)
    assert a.secret != b.secret and len(a.secret) >= 24  # 144 bits
    a.expires_at = time.time() - 5  # it could not be renewed while no daemon answered
    adopted = table.adopt(a, time.time())
    assert table.get(a.id, time.time()) is adopted and adopted.secret == a.secret
    assert adopted.expires_at > time.time() + 50
