"""Leases tied to the caller the kernel proves: PIDs the daemon cannot see are refused, a
neighbour can neither lease in a victim's process, nor exhaust the table, nor read, renew or
end another user's leases. Users here are real uids (the test drops a child process to them),
on a daemon that serves every local user over loopback TCP (``--trust-local-users``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from harness.daemon_process import DaemonProcess, lease_body, start_daemon
from harness.hostile.memory import RssBack
from harness.hostile.probe import HealthProbe
from harness.hostile.users import NOBODY, OTHER, UserAgent, needs_root, process_of
from harness.waiting import wait_for

CAPS = {
    "WEIGHT_CACHE_MAX_LEASES": "40",
    "WEIGHT_CACHE_MAX_LEASES_PER_UID": "20",
    "WEIGHT_CACHE_MAX_LEASES_PER_CLIENT": "10",
    "WEIGHT_CACHE_TRUST_LOCAL_USERS": "true",
}


def _release_all(daemon: DaemonProcess) -> None:
    """The daemon's own user sees and may end every lease."""
    with httpx.Client(base_url=daemon.url) as client:
        for lease in client.get("/v1/leases").json():
            assert client.delete(f"/v1/leases/{lease['id']}").status_code in (204, 404, 410)


def test_pids_the_daemon_cannot_see_are_refused(shared: DaemonProcess) -> None:
    """Leases for PIDs of no process were accepted unwatched, never reaped, and filled the
    4,096 cap in 4 s: now each is refused at once and the table stays empty."""
    with (
        RssBack(shared.process.pid),
        HealthProbe(shared.url) as probe,
        httpx.Client(base_url=shared.url) as client,
    ):
        codes = {
            client.post("/v1/leases", json=lease_body(client_pid=4_000_000 + i)).json()["code"]
            for i in range(500)
        }
        assert codes == {"client_not_visible"}
        assert client.get("/v1/inventory").json()["active_leases"] == 0
        mine = client.post("/v1/leases", json=lease_body())
        assert mine.status_code == 201
        assert mine.json()["lease"]["pid_watched"]
        assert mine.json()["lease"]["holder_pid"] == os.getpid()
        client.delete(f"/v1/leases/{mine.json()['lease']['id']}")
    probe.assert_answered()


def test_a_zombie_client_is_not_a_client(shared: DaemonProcess) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # a zombie until we reap it
    try:
        r = httpx.post(f"{shared.url}/v1/leases", json=lease_body(client_pid=child.pid))
        assert r.status_code == 403 and r.json()["code"] == "client_not_visible"
    finally:
        child.wait()


@needs_root
def test_a_neighbour_cannot_lease_in_a_victims_process(shared: DaemonProcess) -> None:
    """Leases taken in a live victim's PID used to make the victim's own lease fail with 429:
    another user's PID is refused, and the victim keeps its whole allowance."""
    with process_of(OTHER) as victim:
        try:
            with UserAgent(shared.url, NOBODY) as neighbour:
                for _ in range(30):
                    status, body = neighbour.request(
                        "POST", "/v1/leases", lease_body(client_pid=victim.pid)
                    )
                    assert status == 403 and body["code"] == "client_not_yours"
                status, body = neighbour.request("POST", "/v1/leases", lease_body(client_pid=1))
                assert status == 403 and body["code"] == "client_not_yours"  # init is root's
            with UserAgent(shared.url, OTHER) as same_user:
                for _ in range(10):  # the victim's own user leases for it, up to the process cap
                    status, body = same_user.request(
                        "POST", "/v1/leases", lease_body(client_pid=victim.pid)
                    )
                    assert status == 201, body
                    assert body["lease"]["holder_uid"] == OTHER
        finally:
            _release_all(shared)


@needs_root
def test_a_neighbour_cannot_exhaust_the_table(shared: DaemonProcess) -> None:
    """One user takes leases from several of its processes: it stops at its own cap
    (--max-leases-per-uid), and another user still leases."""
    agents = [UserAgent(shared.url, NOBODY) for _ in range(3)]
    try:
        granted = 0
        last = None
        for agent in agents:
            for _ in range(12):
                status, body = agent.request("POST", "/v1/leases", lease_body(client_pid=agent.pid))
                granted += status == 201
                last = body if status != 201 else last
        assert granted == 20  # per_client 10 per process, then per_uid 20 for the user
        assert last is not None and last["code"] == "too_many_user_leases"
        with UserAgent(shared.url, OTHER) as other:
            status, body = other.request("POST", "/v1/leases", lease_body(client_pid=other.pid))
            assert status == 201, body
    finally:
        for agent in agents:
            agent.close()
        _release_all(shared)


@needs_root
def test_leases_are_private_to_their_user(shared: DaemonProcess) -> None:
    """Any client could list every lease id and end or renew anyone's: now only the user that
    took a lease (or the daemon's own user, root, or a token holder) sees or touches it."""
    with (
        RssBack(shared.process.pid),
        UserAgent(shared.url, NOBODY) as holder,
        UserAgent(shared.url, OTHER) as thief,
    ):
        status, body = holder.request("POST", "/v1/leases", lease_body(client_pid=holder.pid))
        assert status == 201, body
        lease = body["lease"]
        assert (lease["holder_uid"], lease["holder_pid"]) == (NOBODY, holder.pid)
        path = f"/v1/leases/{lease['id']}"
        status, listed = thief.request("GET", "/v1/leases")
        assert status == 200 and listed == []
        for method, where in (("GET", path), ("POST", f"{path}/renew"), ("DELETE", path)):
            status, body = thief.request(method, where)
            assert status == 403 and body["code"] == "lease_not_yours", (method, body)
        status, listed = holder.request("GET", "/v1/leases")
        assert [x["id"] for x in listed] == [lease["id"]]
        assert holder.request("POST", f"{path}/renew")[0] == 200
        everyone = httpx.get(f"{shared.url}/v1/leases").json()  # the daemon's user: all
        assert [x["id"] for x in everyone] == [lease["id"]]
        assert holder.request("DELETE", path)[0] == 204


def test_a_token_holders_engine_out_of_sight_holds_its_lease_by_ttl(
    tmp_path: Path, tiny_fp8: Path
) -> None:
    """An engine in a container of its own (compose, a pod) leases over TCP with the token, and
    its pid names no process here: the lease is held unwatched and ends with its TTL (without
    the token such a pid is refused: ``test_pids_the_daemon_cannot_see_are_refused``)."""
    token = "s3cret-token-0123456789"
    daemon = start_daemon(
        tmp_path, [tiny_fp8], "--model-id", "tiny", env={"WEIGHT_CACHE_TOKEN": token}
    )
    try:
        with httpx.Client(base_url=daemon.url) as client:
            out_of_sight = lease_body(client_pid=4_000_000, ttl_s=1.0)
            auth = {"authorization": f"Bearer {token}"}
            r = client.post("/v1/leases", json=out_of_sight, headers=auth)
            assert r.status_code == 201, r.text
            lease = r.json()["lease"]
            assert not lease["pid_watched"] and lease["holder_pid"] is None
            path = f"/v1/leases/{lease['id']}"
            wait_for(lambda: client.get(path, headers=auth).status_code == 410, timeout=15)
            assert client.get(path, headers=auth).json()["code"] == "lease_expired"
    finally:
        daemon.stop()
