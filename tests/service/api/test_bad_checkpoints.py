"""Every broken checkpoint of the corpus, loaded through the API: each ends ``failed`` with its
typed error naming the file, holds no memory, and leaves the daemon and its other model
healthy. A symlink out of the allowed root is refused before anything is read."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.demo import SCHEMES, write_demo_checkpoint
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


DONATED_FORMATS = [
    ("fp8-block", "quant_method is 'fp8', not 'modelopt'"),
    ("bf16", "no hf_quant_config.json and no modelopt quantization_config"),
]


def test_the_formats_said_not_processed_by_the_daemon_are_those_it_refuses() -> None:
    """``DemoFormat.processed_by_daemon`` (what the restart proof starts the daemon by) is
    false exactly for the formats the next test shows refused."""
    donated = {name for name, f in SCHEMES.items() if not f.processed_by_daemon}
    assert donated == {scheme for scheme, _ in DONATED_FORMATS}


@pytest.mark.parametrize(("scheme", "named"), DONATED_FORMATS)
def test_a_format_engines_donate_is_refused_by_name(
    served: Served, tmp_path: Path, scheme: str, named: str
) -> None:
    """Block FP8 and bf16 are not the daemon's to process: the load fails saying which format
    it is not (an engine on it donates instead, docs/donations.md)."""
    checkpoint = write_demo_checkpoint(tmp_path / scheme, scheme, "tiny-128")
    r = served.client.post("/v1/models", json={"path": str(checkpoint), "id": scheme})
    assert r.status_code == 202, r.text
    info = served.wait_ready(scheme)
    assert info["state"] == "failed" and info["bytes_resident"] == 0
    assert info["error"]["code"] == "not_modelopt_checkpoint", info["error"]
    assert named in info["error"]["detail"]
