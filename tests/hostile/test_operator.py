"""An operator's first hour, each stumble of the probe as a test: demo checkpoints other users
can read, a Hugging Face repo id named after the repo (and found by the engine too), ``/ready``
that means ready, ``status`` that recognises another web server, ``serve --log-format json``,
and refusals that say what is wrong."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from harness.checkpoint_tools import hub_snapshot
from harness.cli import run_cli
from harness.daemon_process import lease_body, make_settings, start_daemon
from harness.hostile.users import NOBODY, needs_root
from harness.python_child import run_python
from harness.waiting import wait_for
from modelopt_fp8.checkpoint.locate import local_checkpoint
from service.api.app import create_app
from tests.hostile.conftest import Hostile
from weight_cache_cli import cli
from weight_cache_cli.serve import build_settings


def test_demo_checkpoints_are_readable_by_other_users(tmp_path: Path) -> None:
    """demo-checkpoint wrote its weights 0600: a container's user could not read them."""
    old = os.umask(0o022)
    try:
        result = CliRunner().invoke(cli, ["demo-checkpoint", str(tmp_path / "demo")])
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    for f in (tmp_path / "demo").iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f.name


@needs_root
def test_another_user_reads_a_demo_checkpoint() -> None:
    where = Path(tempfile.mkdtemp(prefix="wc-demo-", dir="/dev/shm"))
    where.chmod(0o755)  # a directory others may enter, as a shared models directory is
    out = where / "demo"
    CliRunner().invoke(cli, ["demo-checkpoint", str(out)])
    code = (
        f"import os, sys; os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY}); "
        "print(len(open(sys.argv[1], 'rb').read(8)))"
    )
    read = run_python(code, str(out / "model.safetensors"), timeout=30, check=False)
    shutil.rmtree(where)
    assert read.stdout.strip() == "8", read.stderr


def test_a_repo_id_is_named_after_the_repo_and_found_by_the_engine(
    tmp_path: Path, tiny_fp8: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cached repo id became the model id as the snapshot's hash, and vLLM given the same id
    fell back (not_local_checkpoint). The id is now ``Org--Name`` (the cache's spelling of
    Org/Name), and the engine resolves the id to the same snapshot, at vLLM's revision."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = hub_snapshot(tmp_path / "hub", "nvidia/Tiny-FP8", tiny_fp8)
    settings = build_settings(models=("nvidia/Tiny-FP8",))
    assert settings.startup_models() == [(snapshot.resolve(), "nvidia--Tiny-FP8")]
    assert local_checkpoint("nvidia/Tiny-FP8") == snapshot
    assert local_checkpoint("nvidia/Tiny-FP8", revision="0123abcd") == snapshot
    assert local_checkpoint("nvidia/Tiny-FP8", revision="other") is None
    assert local_checkpoint("nvidia/Absent") is None
    assert local_checkpoint(str(tiny_fp8)) == tiny_fp8


def test_ready_means_a_model_held_none_loading_none_failed(
    tmp_path: Path, tiny_fp8: Path, copy_of, held_load: threading.Event
) -> None:
    """/ready was 200 while an API-loaded model loaded, with zero models and with failed
    models; each is now 503 with its reason (failed ones allowed with --keep-going)."""
    broken = copy_of(tiny_fp8)
    (broken / "config.json").write_text("{}")
    settings = make_settings(tmp_path, [], allowed_roots=[tiny_fp8.parent, broken.parent])
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        r = client.get("/ready")
        assert r.status_code == 503 and "no model is loaded" in r.json()["reason"]
        assert client.post("/v1/models", json={"path": str(tiny_fp8), "id": "t"}).status_code == 202
        r = client.get("/ready")
        assert r.status_code == 503 and r.json()["waiting"] == ["t"]
        held_load.set()
        wait_for(lambda: client.get("/ready").status_code == 200)
        assert client.post("/v1/models", json={"path": str(broken), "id": "b"}).status_code == 202
        wait_for(lambda: client.get("/v1/models/b").json()["state"] == "failed")
        r = client.get("/ready")
        assert r.status_code == 503 and "invalid_config" in r.json()["failed"]["b"]
        assert "--keep-going" in r.json()["reason"]
    kept = make_settings(
        tmp_path, [], allowed_roots=[tiny_fp8.parent, broken.parent], keep_going=True
    )
    with TestClient(create_app(kept), raise_server_exceptions=False) as client:
        client.post("/v1/models", json={"path": str(broken), "id": "b"})
        wait_for(lambda: client.get("/v1/models/b").json()["state"] == "failed")
        r = client.get("/ready")
        assert r.status_code == 200 and r.json()["failed"]["b"]


@pytest.fixture
def other_web_server() -> Iterator[str]:
    """A web server that is not the daemon: HTML pages, 404 for everything."""

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"<html><body><h1>404 Not Found</h1>nginx</body></html>"
            self.send_response(404)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_status_against_another_web_server_is_bad_response(other_web_server: str) -> None:
    """It printed internal_error and the HTML page; the README promises bad_response."""
    out = run_cli("status", "--url", other_web_server, timeout=60)
    assert out.returncode == 1
    assert "[bad_response]" in out.stderr and "internal_error" not in out.stderr
    assert "<html>" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_serve_takes_the_log_format_after_the_command(tmp_path: Path, tiny_fp8: Path) -> None:
    """`serve --log-format json` said only "No such option"."""
    daemon = start_daemon(tmp_path, [tiny_fp8], "--model-id", "tiny", "--log-format", "json")
    try:
        assert httpx.get(f"{daemon.url}/health").status_code == 200
    finally:
        daemon.stop()
    lines = [x for x in daemon.log.read_text().splitlines() if x.strip()]
    assert lines and all(json.loads(x)["level"] for x in lines)


def test_refusals_say_what_is_wrong(hostile: Hostile) -> None:
    r = hostile.client.post(
        "/v1/leases", content=b'{"model": ', headers={"content-type": "application/json"}
    )
    assert r.status_code == 422
    assert r.json()["detail"].startswith("the body is not valid JSON: Expecting value at")
    r = hostile.client.post(
        "/v1/leases", content=json.dumps(lease_body()), headers={"content-type": "text/plain"}
    )
    assert r.status_code == 422
    assert "Content-Type: application/json" in r.json()["detail"]
    assert "text/plain" in r.json()["detail"]
    # A TTL above the daemon's --max-ttl: the errors the hint points to are there.
    r = hostile.lease(ttl_s=80_000.0)
    assert r.status_code == 422 and r.json()["hint"].endswith("`errors` lists the fields")
    assert r.json()["errors"][0]["loc"] == ["body", "ttl_s"]
    assert "--max-ttl" in r.json()["detail"]


@pytest.mark.parametrize("budget", ["40 gigs", "lots", "GiB"])
def test_a_memory_budget_that_is_no_size_says_how_to_write_one(tmp_path: Path, budget) -> None:
    result = CliRunner().invoke(
        cli, ["serve", "--memory-budget", budget], env={"WEIGHT_CACHE_CACHE_DIR": str(tmp_path)}
    )
    assert result.exit_code == 2
    assert f"'{budget}' is not a size" in result.output and "40GiB" in result.output
