"""Loading over the API (allowed roots, background loads, failures), inspecting and unloading."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.service.api.conftest import Served


def test_startup_model_is_listed(served: Served, tiny_fp8: Path) -> None:
    (model,) = served.client.get("/v1/models").json()
    assert model["id"] == "tiny" and model["state"] == "ready"
    assert model["path"] == str(tiny_fp8)
    assert model["tensors"] == 35 and model["layers"] == 8 and model["tp_size"] == 1
    assert model["progress"]["bytes_done"] == model["progress"]["bytes_total"] > 0
    assert model["progress"]["tensors_done"] == model["progress"]["tensors_total"] == 35
    assert model["bytes_resident"] >= model["progress"]["bytes_total"]
    assert model["quant_algo"] == "FP8" and model["architecture"] == "LlamaForCausalLM"


def test_load_over_the_api(served: Served, tiny_pc: Path) -> None:
    r = served.client.post("/v1/models", json={"path": str(tiny_pc), "id": "pc", "tp_size": 2})
    assert r.status_code == 202, r.text
    assert r.headers["location"] == "/v1/models/pc"
    info = served.wait_ready("pc")
    assert info["state"] == "ready" and info["tp_size"] == 2
    assert len(list(served.shm_dir.iterdir())) == 3  # tiny + two ranks of pc
    for rank in (0, 1):
        grant = served.client.post(
            "/v1/leases", json=served.lease_body(model="pc", tp_rank=rank, tp_size=2)
        ).json()
        assert grant["manifest"]["tp_rank"] == rank
        assert grant["manifest"]["layers"][2]["logical_widths"] == [42, 42]


def test_default_id_is_the_directory_name(served: Served, tiny_pc: Path) -> None:
    assert served.client.post("/v1/models", json={"path": str(tiny_pc)}).json()["id"] == "tiny-pc"


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"path": "/etc"}, 403, "path_not_allowed"),
        ({"path": "/nonexistent/model"}, 403, "path_not_allowed"),
        ({"path": "PLACEHOLDER/missing"}, 404, "checkpoint_not_found"),
        ({"path": "PLACEHOLDER/../../../etc"}, 403, "path_not_allowed"),
        ({"path": "x", "id": "../evil"}, 422, "invalid_request"),
        ({"path": "x", "tp_size": 0}, 422, "invalid_request"),
        ({"path": "x", "extra": 1}, 422, "invalid_request"),
        ({"path": ""}, 422, "invalid_request"),
    ],
)
def test_load_refusals_change_nothing(
    served: Served, tmp_path: Path, body: dict, status: int, code: str
) -> None:
    body = {
        k: (v.replace("PLACEHOLDER", str(tmp_path)) if isinstance(v, str) else v)
        for k, v in body.items()
    }
    before = served.snapshot()
    r = served.client.post("/v1/models", json=body)
    assert (r.status_code, r.json()["code"]) == (status, code), r.text
    assert served.snapshot() == before


def test_duplicate_id(served: Served, tiny_pc: Path) -> None:
    before = served.snapshot()
    r = served.client.post("/v1/models", json={"path": str(tiny_pc), "id": "tiny"})
    assert r.status_code == 409 and r.json()["code"] == "model_exists"
    # it says what to do: unload first (a failed load keeps its id until then)
    assert "DELETE /v1/models/tiny" in r.json()["detail"] and r.json()["state"] == "ready"
    assert r.json()["hint"].startswith("unload it first")
    assert served.snapshot() == before


def test_symlink_out_of_the_allowed_root(served: Served, tmp_path: Path, tiny_fp8: Path) -> None:
    inside = tmp_path / "inside"
    inside.mkdir()
    for f in tiny_fp8.iterdir():
        (inside / f.name).write_bytes(f.read_bytes())
    outside = tmp_path.parent / f"outside-{os.getpid()}.safetensors"
    outside.write_bytes((tiny_fp8 / "model.safetensors").read_bytes())
    try:
        (inside / "model.safetensors").unlink()
        (inside / "model.safetensors").symlink_to(outside)
        served.daemon.settings.allowed_roots = [inside]
        before = served.snapshot()
        r = served.client.post("/v1/models", json={"path": str(inside), "id": "sneaky"})
        assert r.status_code == 403 and r.json()["code"] == "path_not_allowed"
        assert served.snapshot() == before
    finally:
        outside.unlink()


def test_no_allowed_root_disables_api_loads(serve, tiny_pc: Path) -> None:
    served = serve(allowed_roots=[])
    r = served.client.post("/v1/models", json={"path": str(tiny_pc)})
    assert r.status_code == 403 and "allowed-root" in r.json()["detail"]


def test_broken_checkpoint_fails_with_its_reason_and_holds_nothing(
    served: Served, tiny_fp8: Path, copy_of
) -> None:
    broken = copy_of(tiny_fp8)
    raw = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    before = served.snapshot()
    assert (
        served.client.post("/v1/models", json={"path": str(broken), "id": "bad"}).status_code == 202
    )
    info = served.wait_ready("bad")
    assert info["state"] == "failed" and info["bytes_resident"] == 0
    assert info["error"]["code"] == "corrupt_safetensors"
    assert info["error"]["file"].endswith("model.safetensors")
    after = served.snapshot()
    assert (
        after["shm_files"] == before["shm_files"] and after["cache_bytes"] == before["cache_bytes"]
    )
    assert served.client.get("/v1/models/tiny").json()["state"] == "ready"
    r = served.client.get("/ready")  # a failed model is not ready, wherever it came from
    assert r.status_code == 503 and "corrupt_safetensors" in r.json()["failed"]["bad"]
    assert served.client.delete("/v1/models/bad").status_code == 204
    assert served.client.get("/ready").status_code == 200


def test_unload_refused_while_leased_then_frees_memory(served: Served) -> None:
    lease = served.client.post("/v1/leases", json=served.lease_body()).json()["lease"]["id"]
    before = served.snapshot()
    r = served.client.delete("/v1/models/tiny")
    assert r.status_code == 409 and r.json()["code"] == "model_in_use"
    assert r.json()["active_leases"] == 1
    assert served.snapshot() == before
    served.client.delete(f"/v1/leases/{lease}")
    assert served.client.delete("/v1/models/tiny").status_code == 204
    assert served.client.get("/v1/models/tiny").status_code == 404
    assert served.client.get("/v1/inventory").json()["cache_bytes"] == 0
    assert list(served.shm_dir.iterdir()) == []


def test_unload_unknown(served: Served) -> None:
    r = served.client.delete("/v1/models/ghost")
    assert r.status_code == 404 and r.json()["code"] == "model_not_found"


def test_unload_while_loading_cancels(serve, tiny_fp8: Path, held_load) -> None:
    served = serve(wait=False)
    assert served.client.delete("/v1/models/tiny").status_code == 204
    held_load.set()
    served.daemon.models.join_loads(10)
    assert served.client.get("/v1/models").json() == []
    assert list(served.shm_dir.iterdir()) == []


def test_memory_budget_refuses_before_allocating(serve, tiny_pc: Path) -> None:
    served = serve(memory_budget_bytes=200_000)
    before = served.snapshot()
    served.client.post("/v1/models", json={"path": str(tiny_pc), "id": "big"})
    info = served.wait_ready("big")
    assert info["state"] == "failed" and info["error"]["code"] == "insufficient_memory"
    after = served.snapshot()
    assert after["shm_files"] == before["shm_files"]
    assert served.client.get("/v1/inventory").json()["memory_budget"] == 200_000


def test_concurrent_loads_cannot_overrun_the_budget(serve, tiny_pc: Path, tiny_fp8: Path) -> None:
    """Two loads at once, each fitting the budget alone but not together: one is refused."""
    served = serve(models=[], memory_budget_bytes=150_000)
    for name, path in (("a", tiny_pc), ("b", tiny_fp8)):
        assert (
            served.client.post("/v1/models", json={"path": str(path), "id": name}).status_code
            == 202
        )
    states = sorted((served.wait_ready(m)["state"], served.wait_ready(m)["error"]) for m in "ab")
    assert [s for s, _ in states] == ["failed", "ready"]
    assert states[0][1]["code"] == "insufficient_memory"
    assert served.client.get("/v1/inventory").json()["cache_bytes"] <= 150_000
