"""``/v1/parking`` and ``/v1/startup-slots`` through the real app: the contract, the model's
summary, metrics, caps, and long-polls that answer when the state changes or time is up."""

from __future__ import annotations

import os
import threading
from typing import Any

from harness.waiting import wait_for
from protocol.schemas.parking import ParkedEngine
from protocol.schemas.startup_slots import SlotTicket
from tests.service.api.conftest import Served


def _rank_body(group: str, **fields: Any) -> dict[str, Any]:
    """One rank of one engine of this process, in ``group``, with ``fields`` added or changed."""
    return {"tp_rank": 0, "tp_size": 1, "client_pid": os.getpid(), "group": group, **fields}


def park_body(group: str = "g1", **over: Any) -> dict[str, Any]:
    return _rank_body(group, **{"model": "tiny", **over})


def slot_body(group: str = "g1", **over: Any) -> dict[str, Any]:
    return _rank_body(group, **{"device": "GPU-0000", **over})


def test_park_list_summary_release_and_withdraw(served: Served) -> None:
    c = served.client
    r = c.post("/v1/parking", json=park_body())
    assert r.status_code == 201, r.text
    parked = ParkedEngine.model_validate(r.json())
    assert r.headers["location"] == f"/v1/parking/{parked.id}"
    assert parked.state.value == "parked" and parked.pid_watched
    assert parked.boot_id == served.daemon.boot_id
    assert [p["id"] for p in c.get("/v1/parking").json()] == [parked.id]
    summary = c.get("/v1/models/tiny").json()["parked"]
    assert summary == {
        "count": 1,
        "standby": 0,
        "since": parked.parked_at,
        "pids": [os.getpid()],
    }
    inventory = c.get("/v1/inventory").json()
    assert inventory["models"][0]["parked"]["count"] == 1
    assert "weight_cache_parked_engines 1.0" in c.get("/metrics").text

    released = c.post(f"/v1/parking/{parked.id}/release").json()
    assert [(p["id"], p["state"], p["cause"]) for p in released] == [
        (parked.id, "released", "operator")
    ]
    assert c.get(f"/v1/parking/{parked.id}").json()["state"] == "released"
    assert c.get("/v1/models/tiny").json()["parked"]["count"] == 0
    metrics = c.get("/metrics").text
    assert 'weight_cache_parked_releases_total{cause="operator"} 1.0' in metrics
    assert c.delete(f"/v1/parking/{parked.id}").status_code == 204
    gone = c.get(f"/v1/parking/{parked.id}")
    assert gone.status_code == 404 and gone.json()["code"] == "parking_not_found"


def test_release_oldest_of_a_model_and_cancel(served: Served) -> None:
    c = served.client
    first = c.post("/v1/parking", json=park_body("a")).json()
    second = c.post("/v1/parking", json=park_body("b")).json()
    nothing = c.post("/v1/parking/models/tiny/release?tp_size=2")
    assert nothing.status_code == 409 and nothing.json()["code"] == "nothing_parked"
    (released,) = c.post("/v1/parking/models/tiny/release").json()
    assert released["id"] == first["id"]
    (cancelled,) = c.post(f"/v1/parking/{second['id']}/cancel").json()
    assert cancelled["state"] == "cancelled" and cancelled["cause"] is None
    assert c.post("/v1/parking/models/tiny/release").status_code == 409


def test_refusals(served: Served) -> None:
    c = served.client
    unknown = c.post("/v1/parking", json=park_body(model="nope"))
    assert unknown.status_code == 404 and unknown.json()["code"] == "model_not_found"
    assert c.post("/v1/parking", json=park_body(group="bad group")).status_code == 422
    assert c.post("/v1/parking", json=park_body(tp_rank="0")).status_code == 422  # strict
    assert c.get("/v1/parking/nothex").status_code == 422
    assert c.get("/v1/parking/ab.cd?wait_s=61").status_code == 422  # long-polls are bounded
    assert c.get("/v1/startup-slots/nothex").status_code == 422
    assert c.delete("/v1/startup-slots/nothex").status_code == 422
    assert c.get("/v1/startup-slots/ab.cd?wait_s=61").status_code == 422
    old = c.get("/v1/parking/0123.abcd")
    assert old.status_code == 409 and old.json()["code"] == "daemon_restarted"
    assert served.client.get("/v1/parking").json() == []


def test_caps_per_client_and_in_all(serve) -> None:
    served: Served = serve(max_parked=3, max_parked_per_client=2)
    c = served.client
    for group in ("a", "b"):
        assert c.post("/v1/parking", json=park_body(group)).status_code == 201
    mine = c.post("/v1/parking", json=park_body("c"))
    assert mine.status_code == 429 and mine.json()["code"] == "too_many_client_parked"
    assert c.post("/v1/parking", json=park_body("c", client_pid=1)).status_code == 201
    full = c.post("/v1/parking", json=park_body("d", client_pid=1))
    assert full.status_code == 429 and full.json()["code"] == "too_many_parked"
    assert len(c.get("/v1/parking").json()) == 3
    assert 'weight_cache_refusals_total{code="too_many_parked"} 1.0' in c.get("/metrics").text


def test_a_long_poll_answers_when_released(served: Served) -> None:
    c = served.client
    parked = c.post("/v1/parking", json=park_body()).json()
    answers: list[dict[str, Any]] = []
    waiting = threading.Thread(
        target=lambda: answers.append(c.get(f"/v1/parking/{parked['id']}?wait_s=50").json())
    )
    waiting.start()
    wait_for(lambda: parked["id"] in _waited_on(served))  # the poll is waiting on the loop
    assert answers == []
    c.post(f"/v1/parking/{parked['id']}/release")
    waiting.join(30)
    assert [a["state"] for a in answers] == ["released"]


def test_a_long_poll_answers_parked_when_its_time_is_up(served: Served) -> None:
    parked = served.client.post("/v1/parking", json=park_body()).json()
    r = served.client.get(f"/v1/parking/{parked['id']}?wait_s=0.2")
    assert r.status_code == 200 and r.json()["state"] == "parked"
    assert _waited_on(served) == set()  # nothing left behind by the finished poll


def _waited_on(served: Served) -> set[str]:
    return set(served.client.app.state.waits._events)  # type: ignore[attr-defined]


def test_startup_slots_one_at_a_time(served: Served) -> None:
    c = served.client
    first = c.post("/v1/startup-slots", json=slot_body("a"))
    assert first.status_code == 201, first.text
    held = SlotTicket.model_validate(first.json())
    assert held.state.value == "held" and held.ahead == 0
    assert first.headers["location"] == f"/v1/startup-slots/{held.id}"
    queued = SlotTicket.model_validate(
        c.post("/v1/startup-slots", json=slot_body("b", client_pid=1)).json()
    )
    assert queued.state.value == "waiting" and queued.ahead == 1
    assert c.get(f"/v1/startup-slots/{queued.id}?wait_s=0.1").json()["state"] == "waiting"
    answers: list[dict[str, Any]] = []
    waiting = threading.Thread(
        target=lambda: answers.append(c.get(f"/v1/startup-slots/{queued.id}?wait_s=50").json())
    )
    waiting.start()
    wait_for(lambda: queued.id in _waited_on(served))
    metrics = c.get("/metrics").text
    assert 'weight_cache_startup_slot_tickets{state="waiting"} 1.0' in metrics
    assert c.delete(f"/v1/startup-slots/{held.id}").status_code == 204
    waiting.join(30)
    assert [(a["state"], a["ahead"]) for a in answers] == [("held", 0)]
    assert [t["id"] for t in c.get("/v1/startup-slots").json()] == [queued.id]
    again = c.delete(f"/v1/startup-slots/{held.id}")
    assert again.status_code == 404 and again.json()["code"] == "startup_slot_not_found"
