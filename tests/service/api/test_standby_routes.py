"""Warm standbys over the API: a lease taken under a standby's group does not serve until the
standby is released; a standby waits only while another engine serves; the serving engine's end
releases it and its leases then serve; a standby whose engine dies is cancelled and releases
nobody; another user's group is not promoted; one process registers every rank of its engine."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from harness.daemon_process import lease_body
from tests.service.api.conftest import Served
from tests.service.api.test_parking_routes import park_body


@pytest.fixture
def holders() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes that stand for engines (lease holders the daemon watches)."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        process.kill()
        process.wait(10)


def engine_process(started: list[subprocess.Popen[bytes]]) -> int:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    started.append(process)
    return process.pid


def lease(served: Served, pid: int, group: str | None = None) -> dict[str, Any]:
    body = lease_body(client_pid=pid, **({"standby_group": group} if group else {}))
    answer = served.client.post("/v1/leases", json=body)
    assert answer.status_code == 201, answer.text
    info: dict[str, Any] = answer.json()["lease"]
    return info


def standby(served: Served, group: str, **over: Any) -> dict[str, Any]:
    body = park_body(group, standby=True, if_serving=True, **over)
    answer = served.client.post("/v1/parking", json=body)
    assert answer.status_code == 201, answer.text
    entry: dict[str, Any] = answer.json()
    return entry


def state(served: Served, registration: dict[str, Any]) -> tuple[str, str | None]:
    entry = served.client.get(f"/v1/parking/{registration['id']}").json()
    return entry["state"], entry["cause"]


def groups(served: Served) -> dict[int, str | None]:
    return {x["client_pid"]: x["standby_group"] for x in served.client.get("/v1/leases").json()}


def kill(process: subprocess.Popen[bytes], served: Served) -> None:
    process.kill()
    process.wait(10)
    served.daemon.sweep()


def test_a_standby_waits_only_while_another_engine_serves(
    served: Served, holders: list[subprocess.Popen[bytes]]
) -> None:
    mine = lease(served, engine_process(holders), "sb-1")
    assert mine["standby_group"] == "sb-1"
    alone = standby(served, "sb-1")  # only its own lease: nobody serves the model
    assert (alone["state"], alone["cause"], alone["standby"]) == ("released", "unserved", True)
    assert groups(served) == {mine["client_pid"]: None}  # released: its lease serves now

    other = lease(served, engine_process(holders), "sb-2")
    waiting = standby(served, "sb-2")
    assert waiting["state"] == "parked"
    summary = served.client.get("/v1/models/tiny").json()["parked"]
    assert (summary["count"], summary["standby"]) == (1, 1)
    assert groups(served)[other["client_pid"]] == "sb-2"


def test_the_serving_engine_ending_releases_the_standby_and_promotes_its_leases(
    served: Served, holders: list[subprocess.Popen[bytes]]
) -> None:
    serving_pid = engine_process(holders)
    lease(served, serving_pid)  # an ordinary engine
    standby_pid = engine_process(holders)
    lease(served, standby_pid, "sb")
    waiting = standby(served, "sb")
    assert state(served, waiting) == ("parked", None)
    kill(holders[0], served)
    assert state(served, waiting) == ("released", "reaped")
    assert groups(served) == {standby_pid: None}
    later = lease(served, standby_pid, "sb")  # a lease taken again under a released group
    assert later["standby_group"] is None


def test_a_sleeping_standbys_end_releases_nobody(
    served: Served, holders: list[subprocess.Popen[bytes]]
) -> None:
    lease(served, engine_process(holders))
    first_pid = engine_process(holders)
    lease(served, first_pid, "sb-1")
    standby(served, "sb-1")
    lease(served, engine_process(holders), "sb-2")
    second = standby(served, "sb-2")
    kill(holders[1], served)  # the first standby's engine dies asleep
    assert state(served, second) == ("parked", None)
    kill(holders[0], served)  # the serving engine dies: the oldest standby left wakes
    assert state(served, second) == ("released", "reaped")


def test_one_process_registers_every_rank_of_its_standby(served: Served) -> None:
    for rank in range(8):  # more ranks than --max-parked-per-client (4) allows engines
        entry = standby(served, "tp8", tp_rank=rank, tp_size=8)
    assert entry["state"] == "released" and entry["cause"] == "unserved"
    for group in ("a", "b", "c"):
        assert served.client.post("/v1/parking", json=park_body(group)).status_code == 201
    refused = served.client.post("/v1/parking", json=park_body("d"))
    assert refused.status_code == 429 and refused.json()["code"] == "too_many_client_parked"


def test_a_group_of_another_user_is_not_promoted(served: Served) -> None:
    table = served.daemon.leases
    from service.registry.lease_holders import Holder

    with served.daemon.lock:
        theirs = table.add("tiny", 0, 1, 60.0, table.now(), Holder(1234, None, None, 4242), "sb")
        mine = table.add("tiny", 0, 1, 60.0, table.now(), Holder(0, None, None, 4243), "sb")
        assert [x.id for x in table.promote("sb", 0)] == [mine.id]
        assert theirs.standby_group == "sb" and mine.serving
        assert table.serving("tiny")
