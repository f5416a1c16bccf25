"""Every broken checkpoint of the corpus, loaded through the API: each ends ``failed`` with its
typed error naming the file, holds no memory, and leaves the daemon and its other model
healthy. A symlink out of the allowed root is refused before anything is read."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.corpus import CORPUS, make_broken
from tests.service.api.conftest import Served


@pytest.mark.parametrize("kind", sorted(CORPUS))
def test_broken_checkpoint(served: Served, tiny_fp8: Path, tmp_path: Path, kind: str) -> None:
    broken = make_broken(tiny_fp8, tmp_path, kind)
    before = served.snapshot()
    r = served.client.post("/v1/models", json={"path": str(broken), "id": kind})
    assert r.status_code == 202, r.text
    info = served.wait_ready(kind)
    assert info["state"] == "failed"
    assert info["error"]["code"] == CORPUS[kind][1], info["error"]
    assert info["error"]["file"] and info["error"]["detail"]
    assert info["bytes_resident"] == 0
    after = served.snapshot()
    assert after["shm_files"] == before["shm_files"]
    assert after["cache_bytes"] == before["cache_bytes"]
    assert served.client.get("/health").status_code == 200
    lease = served.client.post("/v1/leases", json=served.lease_body())
    assert lease.status_code == 201  # the good model is untouched
    r = served.client.post("/v1/leases", json=served.lease_body(model=kind))
    assert r.status_code == 409 and r.json()["reason"] == CORPUS[kind][1]
