"""A shared-memory arena removed or replaced under the daemon: the model turns failed with
``arena_lost`` before any grant names the file, and /ready, the inventory and metrics say so;
the identity digests are published in the model record and every manifest."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from modelopt_fp8.checkpoint import Checkpoint
from tests.service.api.conftest import Served


def arena_file(served: Served) -> Path:
    (path,) = served.shm_dir.iterdir()
    return path


def lose(path: Path, how: str) -> None:
    if how == "removed":
        path.unlink()
    else:  # replaced: another file of the same size under the same name
        other = path.with_name(".impostor")
        other.write_bytes(b"\0" * path.stat().st_size)
        other.rename(path)


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_lost_arena_fails_the_model_before_a_grant(served: Served, how: str) -> None:
    held = served.lease()
    mapped = served.mapped_arena(held)
    before = mapped.clone()
    lose(arena_file(served), how)

    r = served.client.post("/v1/leases", json=served.lease_body())
    assert r.status_code == 409, r.text
    assert r.json()["code"] == "model_failed" and r.json()["reason"] == "arena_lost"
    assert how in r.json()["detail"]

    info = served.client.get("/v1/models/tiny").json()
    assert info["state"] == "failed" and info["error"]["code"] == "arena_lost"
    assert info["bytes_resident"] == 0 and info["active_leases"] == 1
    ready = served.client.get("/ready")
    assert ready.status_code == 503 and "arena_lost" in ready.json()["failed"]["tiny"]
    inventory = served.client.get("/v1/inventory").json()
    assert inventory["cache_bytes"] == 0 and inventory["models"][0]["state"] == "failed"
    assert 'weight_cache_models{state="failed"} 1.0' in served.client.get("/metrics").text
    # The engine that mapped the arena keeps its bytes; its lease can still be renewed.
    assert bool((mapped == before).all())
    renewed = served.client.post(f"/v1/leases/{held.lease.id}/renew")
    assert renewed.status_code == 200


def test_a_model_loaded_over_the_api_is_reported_by_ready_too(serve, tiny_fp8: Path) -> None:
    served = serve(models=[])
    assert served.client.post("/v1/models", json={"path": str(tiny_fp8), "id": "late"}).status_code
    served.wait_ready("late")
    assert served.client.get("/ready").status_code == 200
    lose(arena_file(served), "removed")
    ready = served.client.get("/ready")
    assert ready.status_code == 503 and ready.json()["models"] == {"late": "failed"}
    # Unload and load again: served as before.
    assert served.client.delete("/v1/models/late").status_code == 204
    served.client.post("/v1/models", json={"path": str(tiny_fp8), "id": "late"})
    assert served.wait_ready("late")["state"] == "ready"
    assert served.client.get("/ready").status_code == 200
    assert served.client.post("/v1/leases", json=served.lease_body(model="late")).status_code == 201


def test_an_intact_arena_keeps_granting(served: Served) -> None:
    path = arena_file(served)
    os.utime(path)  # a touch is not a loss
    assert served.client.post("/v1/leases", json=served.lease_body()).status_code == 201


def test_digests_are_published(served: Served, tiny_fp8: Path) -> None:
    with Checkpoint.open(tiny_fp8) as ckpt:
        expected = ckpt.digests.model_copy(update={"full": ckpt.full_digest()})
    info = served.client.get("/v1/models/tiny").json()
    assert info["digests"] == expected.model_dump() and info["fingerprint"] == expected.sampled
    grant = served.lease()
    assert grant.full_manifest().checkpoint.digests == expected
