"""Parked engines and start-up slot tickets tied to the caller the kernel proves, as leases are:
a neighbour can neither see, release, cancel nor withdraw another user's parked engine, nor give
back its start-up slot, nor join its group, nor park in a victim's process, nor take every
place. Users are real uids (child processes dropped to them) on a daemon that serves every local
user over loopback TCP (``--trust-local-users``)."""

from __future__ import annotations

from typing import Any

import httpx

from harness.daemon_process import DaemonProcess
from harness.hostile.users import NOBODY, OTHER, UserAgent, needs_root, process_of

CAPS = {
    "WEIGHT_CACHE_MAX_PARKED": "12",
    "WEIGHT_CACHE_MAX_PARKED_PER_UID": "3",
    "WEIGHT_CACHE_TRUST_LOCAL_USERS": "true",
}


def park_body(pid: int, group: str, rank: int = 0, tp: int = 1) -> dict[str, Any]:
    return {"model": "tiny", "tp_rank": rank, "tp_size": tp, "client_pid": pid, "group": group}


def slot_body(pid: int, group: str) -> dict[str, Any]:
    return {"device": "GPU-test", "tp_rank": 0, "tp_size": 1, "client_pid": pid, "group": group}


def _clear(daemon: DaemonProcess) -> None:
    """The daemon's own user sees and may withdraw every registration."""
    with httpx.Client(base_url=daemon.url) as client:
        for path in ("/v1/parking", "/v1/startup-slots"):
            for entry in client.get(path).json():
                assert client.delete(f"{path}/{entry['id']}").status_code in (204, 404)


@needs_root
def test_parked_engines_are_private_to_their_user(shared: DaemonProcess) -> None:
    try:
        with UserAgent(shared.url, NOBODY) as owner, UserAgent(shared.url, OTHER) as neighbour:
            status, parked = owner.request("POST", "/v1/parking", park_body(owner.pid, "e1", 0, 2))
            assert status == 201, parked
            assert parked["client_pid"] == owner.pid and parked["pid_watched"]
            path = f"/v1/parking/{parked['id']}"
            assert neighbour.request("GET", "/v1/parking") == (200, [])
            for method, where in (
                ("GET", path),
                ("POST", f"{path}/release"),
                ("POST", f"{path}/cancel"),
                ("DELETE", path),
            ):
                status, body = neighbour.request(method, where)
                assert status == 403 and body["code"] == "registration_not_yours", (method, body)
            # joining the owner's group (its rank 1) would make its engine release with ours
            status, body = neighbour.request(
                "POST", "/v1/parking", park_body(neighbour.pid, "e1", 1, 2)
            )
            assert status == 403 and body["code"] == "registration_not_yours", body
            status, body = owner.request("POST", "/v1/parking", park_body(owner.pid, "e1", 1, 2))
            assert status == 201, body
            # the oldest of the model, as the neighbour sees it: none of its own
            status, body = neighbour.request("POST", "/v1/parking/models/tiny/release")
            assert status == 409 and body["code"] == "nothing_parked", body
            status, listed = owner.request("GET", "/v1/parking")
            assert sorted(p["tp_rank"] for p in listed) == [0, 1]
            everyone = httpx.get(f"{shared.url}/v1/parking").json()  # the daemon's user: all
            assert len(everyone) == 2
            status, released = owner.request("POST", "/v1/parking/models/tiny/release")
            assert status == 200 and {p["state"] for p in released} == {"released"}
            assert owner.request("DELETE", path)[0] == 204
    finally:
        _clear(shared)


@needs_root
def test_start_up_slots_are_private_to_their_user(shared: DaemonProcess) -> None:
    try:
        with UserAgent(shared.url, NOBODY) as owner, UserAgent(shared.url, OTHER) as neighbour:
            status, ticket = owner.request("POST", "/v1/startup-slots", slot_body(owner.pid, "s1"))
            assert status == 201 and ticket["state"] == "held", ticket
            path = f"/v1/startup-slots/{ticket['id']}"
            assert neighbour.request("GET", "/v1/startup-slots") == (200, [])
            for method in ("GET", "DELETE"):
                status, body = neighbour.request(method, path)
                assert status == 403 and body["code"] == "registration_not_yours", (method, body)
            status, waiting = neighbour.request(
                "POST", "/v1/startup-slots", slot_body(neighbour.pid, "s2")
            )
            assert status == 201 and waiting["state"] == "waiting" and waiting["ahead"] == 1
            assert owner.request("DELETE", path)[0] == 204
            status, now_held = neighbour.request("GET", f"/v1/startup-slots/{waiting['id']}")
            assert status == 200 and now_held["state"] == "held"
    finally:
        _clear(shared)


@needs_root
def test_a_neighbour_cannot_park_in_a_victims_process_or_take_every_place(
    shared: DaemonProcess,
) -> None:
    agents = [UserAgent(shared.url, NOBODY) for _ in range(2)]
    try:
        neighbour = agents[0]
        with process_of(OTHER) as victim:
            status, body = neighbour.request("POST", "/v1/parking", park_body(victim.pid, "v"))
            assert status == 403 and body["code"] == "client_not_yours", body
            status, body = neighbour.request(
                "POST", "/v1/startup-slots", slot_body(victim.pid, "v")
            )
            assert status == 403 and body["code"] == "client_not_yours", body
        status, body = neighbour.request("POST", "/v1/parking", park_body(4_000_000, "ghost"))
        assert status == 403 and body["code"] == "client_not_visible", body
        codes = [
            agent.request("POST", "/v1/parking", park_body(agent.pid, f"n{agent.pid}-{i}"))[1].get(
                "code", "parked"
            )
            for agent in agents
            for i in range(3)
        ]
        # 4 per process (--max-parked-per-client), 3 per user (--max-parked-per-uid)
        assert codes == ["parked"] * 3 + ["too_many_user_parked"] * 3
        with UserAgent(shared.url, OTHER) as other:
            status, body = other.request("POST", "/v1/parking", park_body(other.pid, "o"))
            assert status == 201, body
    finally:
        for agent in agents:
            agent.close()
        _clear(shared)
