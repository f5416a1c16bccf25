"""Names that are not UTF-8: a checkpoint reached through a directory whose name is bytes no
JSON string can carry. Loading it answered 202, and every later GET /v1/models, /v1/inventory and
``weight-cache status`` answered 500 until the model was deleted. Such names are now shown with
their odd bytes escaped (``\\xff``): every view keeps answering, for that model and the others."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from harness.cli import run_cli
from harness.hostile.memory import RssBack
from harness.hostile.probe import HealthProbe
from tests.hostile.conftest import Hostile

ODD = b"ckpt-\xff\xfe"  # not UTF-8


def _odd_copy(hostile: Hostile) -> Path:
    """A copy of the tiny checkpoint in a directory named ``ODD``, reached by a UTF-8 link."""
    target = hostile.root / os.fsdecode(ODD)  # the odd bytes as surrogate escapes
    if not target.exists():
        shutil.copytree(hostile.tiny, target)
    assert os.fsencode(target).endswith(ODD)
    link = hostile.root / "odd-link"
    if not link.is_symlink():
        link.symlink_to(target)
    return link


def _views_answer(hostile: Hostile, *more: str) -> None:
    for path in ("/v1/models", "/v1/inventory", "/ready", "/metrics", *more):
        r = hostile.client.get(path)
        assert r.status_code in (200, 503), (path, r.status_code, r.text[:300])


def test_a_checkpoint_behind_a_non_utf8_name_keeps_every_view_answering(
    hostile: Hostile,
) -> None:
    link = _odd_copy(hostile)
    with RssBack(hostile.daemon.process.pid), HealthProbe(hostile.url) as probe:
        r = hostile.load(link, "odd")
        assert r.status_code == 202, r.text
        info = hostile.settled("odd")
        assert info["state"] == "ready", info
        assert info["path"].endswith("ckpt-\\xff\\xfe")  # escaped, one line, valid JSON
        _views_answer(hostile, "/v1/models/odd")
        status = run_cli("status", "--url", hostile.url, timeout=60)
        assert status.returncode == 0, status.stderr
        assert "odd" in status.stdout
        lease = hostile.lease(model="odd")
        assert lease.status_code == 201, lease.text
        assert hostile.client.delete(f"/v1/leases/{lease.json()['lease']['id']}").status_code == 204
        hostile.unload("odd")
    probe.assert_answered()


def test_a_lone_surrogate_in_the_request_is_refused(hostile: Hostile) -> None:
    """A JSON string may carry a lone surrogate escape ("\\udcff"), which is no text: refused
    with invalid_request (pydantic's strict strings), and the views keep answering."""
    _odd_copy(hostile)
    body = b'{"path": "' + str(hostile.root).encode() + b'/ckpt-\\udcff\\udcfe", "id": "odd2"}'
    r = hostile.client.post(
        "/v1/models", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == 422 and r.json()["code"] == "invalid_request", r.text
    assert r.json()["errors"][0]["loc"] == ["body", "path"]
    _views_answer(hostile)
