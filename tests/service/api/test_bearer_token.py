"""Bearer tokens: compared exactly, only from the Authorization header."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from weight_cache_cli import cli

TOKEN = "s3cret-Token"


@pytest.fixture
def guarded(serve, tmp_path: Path):
    return serve(token=TOKEN)


def test_health_and_ready_stay_open(guarded) -> None:
    assert guarded.client.get("/health").status_code == 200
    assert guarded.client.get("/ready").status_code == 200


@pytest.mark.parametrize(
    "path", ["/v1/inventory", "/v1/models", "/v1/leases", "/metrics", "/v1/models/tiny"]
)
@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": "Bearer wrong"},
        {"authorization": f"Bearer {TOKEN.lower()}"},
        {"authorization": f"Basic {TOKEN}"},
        {"authorization": TOKEN},
        {"authorization": f"Bearer {TOKEN}x"},
    ],
)
def test_refused_without_the_exact_token(guarded, path: str, headers: dict) -> None:
    r = guarded.client.get(path, headers=headers)
    assert r.status_code == 401 and r.json()["code"] == "unauthorized"


def test_token_in_query_string_is_ignored(guarded) -> None:
    r = guarded.client.get(f"/v1/inventory?token={TOKEN}&access_token={TOKEN}")
    assert r.status_code == 401


def test_right_token(guarded) -> None:
    for scheme in ("Bearer", "bearer"):
        r = guarded.client.get("/v1/inventory", headers={"authorization": f"{scheme} {TOKEN}"})
        assert r.status_code == 200


def test_lease_refused_without_token_leaves_nothing(guarded) -> None:
    r = guarded.client.post("/v1/leases", json=guarded.lease_body())
    assert r.status_code == 401
    ok = {"authorization": f"Bearer {TOKEN}"}
    assert guarded.client.get("/v1/leases", headers=ok).json() == []


def test_non_loopback_bind_without_token_is_refused(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["serve", "--host", "0.0.0.0", "--model", str(tmp_path)])
    assert result.exit_code == 2
    assert "without a token" in result.output
