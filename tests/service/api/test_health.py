"""Health and readiness, and inventory of devices and memory."""

from __future__ import annotations

from pathlib import Path

from tests.service.api.conftest import Served


def test_health(served: Served) -> None:
    body = served.client.get("/health").json()
    assert body["status"] == "ok" and body["boot_id"] == served.daemon.boot_id
    assert body["version"] and body["protocol_version"] == 1 and body["uptime_s"] >= 0


def test_ready_when_startup_models_are(served: Served) -> None:
    r = served.client.get("/ready")
    assert r.status_code == 200
    assert r.json() == {
        "ready": True,
        "models": {"tiny": "ready"},
        "waiting": [],
        "failed": {},
        "reason": None,
    }


def test_not_ready_when_a_startup_model_failed(serve, tiny_fp8: Path, copy_of) -> None:
    broken = copy_of(tiny_fp8)
    (broken / "config.json").write_text("{}")
    served = serve(models=[broken])
    r = served.client.get("/ready")
    assert r.status_code == 503
    assert r.json()["models"] == {"tiny": "failed"}
    assert "invalid_config" in r.json()["failed"]["tiny"]


def test_inventory(served: Served) -> None:
    inv = served.client.get("/v1/inventory").json()
    (device,) = inv["devices"]
    assert device["kind"] == "cpu" and device["total_memory"] >= device["free_memory"] > 0
    assert inv["cache_bytes"] == inv["models"][0]["bytes_resident"] > 0
    assert inv["active_leases"] == 0 and inv["memory_budget"] is None
    served.client.post("/v1/leases", json=served.lease_body())
    assert served.client.get("/v1/inventory").json()["active_leases"] == 1


def test_a_daemon_holding_no_model_is_not_ready(served: Served, tiny_fp8: Path) -> None:
    """Unloading the last model leaves nothing to lend: /ready says so until one is loaded
    again under the same id."""
    assert served.client.delete("/v1/models/tiny").status_code == 204
    r = served.client.get("/ready")
    assert r.status_code == 503
    assert r.json()["models"] == {} and "no model is loaded" in r.json()["reason"]
    r = served.client.post("/v1/models", json={"path": str(tiny_fp8), "id": "tiny"})
    assert r.status_code == 202
    served.wait_ready("tiny")
    assert served.client.get("/ready").status_code == 200


def test_a_failed_startup_model_stops_the_daemon_unless_keep_going(
    serve, tiny_fp8: Path, copy_of
) -> None:
    broken = copy_of(tiny_fp8)
    (broken / "config.json").write_text("{}")
    served = serve(models=[broken])
    model, error = served.daemon.startup_failure or ("", None)
    assert model == "tiny" and error is not None and error.code == "invalid_config"
    kept = serve(models=[broken], keep_going=True)
    assert kept.daemon.startup_failure is None
    r = kept.client.get("/ready")
    assert r.status_code == 200  # the engine may start, and falls back for this model
    assert (
        r.json()["models"] == {"tiny": "failed"} and "invalid_config" in r.json()["failed"]["tiny"]
    )
