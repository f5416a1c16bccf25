"""Cross-cutting behaviour: problem documents, body limits, metrics, and the API contract."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from protocol.version import __version__
from tests.service.api.conftest import Served
from weight_cache_cli import cli

ROOT = Path(__file__).resolve().parents[3]


def test_unknown_route_is_a_problem(served: Served) -> None:
    r = served.client.get("/v2/nothing")
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    assert r.headers["content-type"].startswith("application/problem+json")
    r = served.client.put("/v1/leases")
    assert r.status_code == 405 and r.json()["code"] == "method_not_allowed"


def test_oversized_bodies_are_refused(served: Served) -> None:
    before = served.snapshot()
    big = {"path": "x" * 100_000}
    r = served.client.post("/v1/models", json=big)
    assert r.status_code == 413 and r.json()["code"] == "payload_too_large"

    def chunks():
        yield b'{"path": "'
        for _ in range(100):
            yield b"x" * 1024
        yield b'"}'

    r = served.client.post(
        "/v1/models", content=chunks(), headers={"content-type": "application/json"}
    )
    assert r.status_code == 413
    assert served.snapshot() == before


def test_metrics(served: Served) -> None:
    served.client.post("/v1/leases", json=served.lease_body())
    served.client.post("/v1/leases", json=served.lease_body(model="ghost"))
    text = served.client.get("/metrics").text
    for line in (
        'weight_cache_models{state="ready"} 1.0',
        "weight_cache_leases_active 1.0",
        'weight_cache_leases_granted_total{via="request"} 1.0',
        'weight_cache_refusals_total{code="model_not_found"} 1.0',
        "weight_cache_lease_grant_duration_seconds_count 1.0",
        "weight_cache_load_duration_seconds_count 1.0",
    ):
        assert line in text, line
    assert 'weight_cache_resident_bytes{model="tiny"}' in text
    (build,) = [line for line in text.splitlines() if line.startswith("weight_cache_build_info{")]
    assert f'version="{__version__}"' in build and build.endswith(" 1.0")
    # Prometheus's conventions: no _created series, no name of the old scheme
    assert "_created" not in text
    for old in ("weight_cache_bytes_resident", "weight_cache_lease_seconds", "load_seconds_"):
        assert old not in text, old


def test_openapi_json_is_the_apps_contract() -> None:
    result = CliRunner().invoke(cli, ["openapi"])
    assert result.exit_code == 0
    generated = json.loads(result.output)
    checked_in = json.loads((ROOT / "openapi.json").read_text())
    assert generated == checked_in, "openapi.json drifted: run `make openapi`"
    paths = set(generated["paths"])
    assert {
        "/health",
        "/ready",
        "/v1/inventory",
        "/v1/models",
        "/v1/models/{model_id}",
        "/v1/leases",
        "/v1/leases/{lease_id}",
        "/v1/leases/{lease_id}/renew",
        "/metrics",
    } <= paths
