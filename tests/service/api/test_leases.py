"""Lease contract: grant, manifest, renew, release, expiry, reaping, and every refusal leaving
nothing changed."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.waiting import wait_for
from modelopt_fp8.checkpoint import Checkpoint
from modelopt_fp8.processing.execute import process_checkpoint
from modelopt_fp8.processing.plan import plan_model
from protocol.schemas.leases import LeaseGrant
from protocol.schemas.manifest import ShmHandle
from tests.service.api.conftest import Served


def test_grant_returns_a_complete_manifest(served: Served, tiny_fp8: Path) -> None:
    r = served.client.post("/v1/leases", json=served.lease_body(ttl_s=30))
    assert r.status_code == 201, r.text
    grant = LeaseGrant.model_validate(r.json())
    assert r.headers["location"] == f"/v1/leases/{grant.lease.id}"
    m = grant.full_manifest()
    assert grant.layout_digest == m.layout_digest
    assert (m.model, m.tp_rank, m.tp_size) == ("tiny", 0, 1)
    assert m.daemon.boot_id == grant.lease.boot_id == served.daemon.boot_id
    assert m.daemon.protocol_version == 1
    assert m.device.kind.value == "cpu" and m.device.uuid and m.device.uuid.startswith("host-")
    assert m.checkpoint.quant_algo == "FP8" and m.checkpoint.fingerprint.startswith("sha256:")
    assert len(m.layers) == 8 and {la.kernel.value for la in m.layers} == {"cutlass"}
    assert all(t.offset % 256 == 0 for t in m.tensors)
    (arena,) = grant.arenas
    assert isinstance(arena.handle, ShmHandle) and Path(arena.handle.path).parent == served.shm_dir
    assert grant.lease.pid_watched and grant.lease.ttl_s == 30
    assert served.client.get(f"/v1/leases/{grant.lease.id}").json()["id"] == grant.lease.id
    assert [x["id"] for x in served.client.get("/v1/leases").json()] == [grant.lease.id]


def test_leased_bytes_equal_an_ordinary_load(served: Served, tiny_fp8: Path) -> None:
    grant = served.lease()
    base = served.mapped_arena(grant)
    with Checkpoint.open(tiny_fp8) as ckpt:
        expected = process_checkpoint(ckpt, plan_model(ckpt))
    for entry in grant.full_manifest().tensors:
        got = entry.view(base)
        want = expected[entry.name]
        assert got.shape == want.shape and got.stride() == want.stride(), entry.name
        assert got.dtype == want.dtype
        assert (
            got.reshape(-1).view(torch.uint8).tolist()
            == want.reshape(-1).view(torch.uint8).tolist()
        ), entry.name


def test_each_grant_gets_its_own_lease(served: Served) -> None:
    a = served.client.post("/v1/leases", json=served.lease_body()).json()
    b = served.client.post("/v1/leases", json=served.lease_body()).json()
    assert a["lease"]["id"] != b["lease"]["id"]
    assert served.client.get("/v1/models/tiny").json()["active_leases"] == 2


def test_renew_and_release(served: Served) -> None:
    lease = served.client.post("/v1/leases", json=served.lease_body(ttl_s=5)).json()["lease"]
    renewed = served.client.post(f"/v1/leases/{lease['id']}/renew", json={"ttl_s": 20}).json()
    assert renewed["renewals"] == 1 and renewed["ttl_s"] == 20
    assert renewed["expires_at"] > lease["expires_at"]
    again = served.client.post(f"/v1/leases/{lease['id']}/renew").json()
    assert again["renewals"] == 2 and again["ttl_s"] == 20
    assert served.client.delete(f"/v1/leases/{lease['id']}").status_code == 204
    for method in ("get", "delete"):
        r = served.client.request(method.upper(), f"/v1/leases/{lease['id']}")
        assert r.status_code == 404 and r.json()["code"] == "lease_not_found"
    assert served.client.get("/v1/leases").json() == []


def test_leases_expire(served: Served) -> None:
    lease = served.client.post("/v1/leases", json=served.lease_body(ttl_s=0.2)).json()["lease"]
    wait_for(lambda: served.client.get("/v1/leases").json() == [], timeout=5)
    r = served.client.post(f"/v1/leases/{lease['id']}/renew")
    assert r.status_code == 410 and r.json()["code"] == "lease_expired"
    assert r.json()["reason"] == "expired"
    assert "weight_cache_leases_expired_total 1.0" in served.client.get("/metrics").text


def test_dead_client_is_reaped(served: Served) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lease = served.client.post(
            "/v1/leases", json=served.lease_body(client_pid=child.pid, ttl_s=600)
        ).json()["lease"]
        assert lease["pid_watched"]
        served.daemon.sweep()  # the reaper's sweep, run now rather than waited for
        assert len(served.client.get("/v1/leases").json()) == 1  # alive: kept
        child.send_signal(signal.SIGKILL)
        child.wait()
        wait_for(lambda: served.client.get("/v1/leases").json() == [], timeout=5)
        r = served.client.get(f"/v1/leases/{lease['id']}")
        assert r.status_code == 410 and r.json()["reason"] == "reaped"
        assert "weight_cache_leases_reaped_total 1.0" in served.client.get("/metrics").text
        assert served.client.get("/v1/models/tiny").json()["state"] == "ready"
    finally:
        child.kill()


def test_lease_from_an_earlier_daemon_run(served: Served) -> None:
    r = served.client.post("/v1/leases/0123456789abcdef.00ff/renew")
    assert r.status_code == 409 and r.json()["code"] == "daemon_restarted"


@pytest.mark.parametrize(
    ("over", "status", "code"),
    [
        ({"model": "nope"}, 404, "model_not_found"),
        ({"kernel": "marlin"}, 409, "layout_mismatch"),
        ({"format": "humming"}, 409, "layout_mismatch"),
        ({"tp_size": 2}, 409, "layout_mismatch"),
        ({"tp_rank": 1}, 422, "invalid_request"),
        ({"tp_rank": -1}, 422, "invalid_request"),
        ({"ttl_s": 7200}, 422, "invalid_request"),
        ({"ttl_s": 1e9}, 422, "invalid_request"),
        ({"ttl_s": -1}, 422, "invalid_request"),
        ({"client_pid": "me"}, 422, "invalid_request"),
        ({"surprise": True}, 422, "invalid_request"),
        ({"model": "../../etc"}, 404, "model_not_found"),
    ],
)
def test_refusals_change_nothing(served: Served, over: dict, status: int, code: str) -> None:
    held = served.client.post("/v1/leases", json=served.lease_body()).json()["lease"]["id"]
    before = served.snapshot()
    r = served.client.post("/v1/leases", json=served.lease_body(**over))
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert r.json()["code"] == code
    assert served.snapshot() == before
    assert held in served.snapshot()["leases"]


def test_layout_mismatch_names_the_fields(served: Served) -> None:
    r = served.client.post("/v1/leases", json=served.lease_body(kernel="marlin", tp_size=2))
    assert r.json()["mismatches"] == {
        "kernel": {"requested": "marlin", "served": "cutlass"},
        "tp_size": {"requested": 2, "served": 1},
    }


def test_malformed_bodies(served: Served) -> None:
    before = served.snapshot()
    for body in (b"{", b"[]", b"null", b'{"model": 3}'):
        r = served.client.post(
            "/v1/leases", content=body, headers={"content-type": "application/json"}
        )
        assert r.status_code == 422 and r.json()["code"] == "invalid_request", body
    assert served.snapshot() == before


def test_lease_while_loading_says_retry_later(serve, tiny_fp8: Path, held_load) -> None:
    served = serve(wait=False)  # the load is held open until the test has asked
    r = served.client.post("/v1/leases", json=served.lease_body())
    assert r.status_code == 503 and r.json()["code"] == "model_loading"
    assert int(r.headers["retry-after"]) >= 1
    assert served.client.get("/v1/leases").json() == []
    ready = served.client.get("/ready")
    assert ready.status_code == 503 and ready.json()["waiting"] == ["tiny"]
    held_load.set()
    assert served.wait_ready("tiny")["state"] == "ready"
    assert served.client.post("/v1/leases", json=served.lease_body()).status_code == 201


def test_lease_on_a_failed_model(serve, tiny_fp8: Path, copy_of) -> None:
    broken = copy_of(tiny_fp8)
    (broken / "model.safetensors").write_bytes(b"\0" * 64)
    served = serve(models=[broken])
    r = served.client.post("/v1/leases", json=served.lease_body())
    assert r.status_code == 409 and r.json()["code"] == "model_failed"
    assert r.json()["reason"] == "corrupt_safetensors"


def test_rendered_grant_is_exactly_the_schemas_json(served: Served) -> None:
    """The grant is spliced from JSON rendered at load time; it must be byte for byte what
    serialising the LeaseGrant model gives."""
    from protocol.schemas.leases import LeaseRequest

    granted = served.daemon.grant(LeaseRequest.model_validate(served.lease_body()))
    assert granted.render() == granted.as_schema().model_dump_json().encode()
    assert LeaseGrant.model_validate_json(granted.render()) == granted.as_schema()


def test_known_layout_skips_the_manifest(served: Served) -> None:
    first = served.lease()
    digest = first.layout_digest
    slim = served.client.post("/v1/leases", json=served.lease_body(known_layout=digest))
    assert slim.status_code == 201
    body = slim.json()
    assert body["manifest"] is None and body["layout_digest"] == digest
    assert body["arenas"][0]["handle"]["kind"] == "shm"
    # What is left is the lease and the handle (a file path, the handle socket's path and the
    # lease's secret: a few hundred bytes, with this test's long temporary paths).
    assert len(slim.content) < len(first.model_dump_json()) / 15
    stale = served.client.post("/v1/leases", json=served.lease_body(known_layout="0" * 32))
    assert stale.json()["manifest"]["layout_digest"] == digest  # a full manifest again
