"""The keeper's lifecycle as a user of ``weight-cache serve`` sees it: Ctrl-C ends the daemon with
status 0 and says what stays, ``keeper --stop`` ends what stays, ``status`` shows the keeper, a
second daemon on the same run directory is told about ``--run-dir``, and an empty ``--model``
means no model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.cli import CLI, run_cli
from harness.daemon_process import free_port, keeper_status, start_daemon, stop_keeper
from harness.waiting import wait_for


class Serving:
    def __init__(self, process: subprocess.Popen[str], url: str, log: Path) -> None:
        self.process, self.url, self.log = process, url, log

    def answers(self, path: str = "/health") -> bool:
        try:
            return httpx.get(f"{self.url}{path}").status_code == 200
        except httpx.HTTPError:
            return False


def serve(tmp_path: Path, name: str, *args: str, env: dict[str, str] | None = None) -> Serving:
    port = free_port()
    log = tmp_path / f"{name}.log"
    with log.open("w") as sink:
        process = subprocess.Popen(
            [*CLI, "serve", "--port", str(port), "--device", "cpu", "--shm-dir", str(tmp_path),
             "--cache-dir", str(tmp_path / "cache"), *args],
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
            cwd=tmp_path,
        )  # fmt: skip
    return Serving(process, f"http://127.0.0.1:{port}", log)


@pytest.fixture
def run_dir(tmp_path: Path) -> Iterator[Path]:
    run = tmp_path / "run"
    yield run
    stop_keeper(run)


def test_ctrl_c_exits_0_and_says_what_stays_then_keeper_stop_ends_it(
    tmp_path: Path, tiny_fp8: Path, run_dir: Path
) -> None:
    daemon = start_daemon(
        tmp_path, [tiny_fp8], "--model-id", "tiny", run_dir=run_dir, keeper="auto"
    )
    keeper = httpx.get(f"{daemon.url}/v1/inventory").json()["keeper"]
    held = keeper_status(run_dir)
    assert keeper == {
        "mode": "auto",
        "socket": str(run_dir / "keeper.sock"),
        "attached": True,
        "pid": held.pid,
        "started_by_daemon": True,
    }
    status = run_cli("status", "--url", daemon.url, check=True).stdout
    assert f"keeper: auto, pid {held.pid}, started by the daemon, attached" in status

    daemon.process.send_signal(signal.SIGINT)  # what Ctrl-C sends
    assert daemon.process.wait(30) == 0
    log = daemon.log.read_text()
    assert "Aborted" not in log and "Traceback" not in log
    assert log.splitlines()[-1].endswith(
        f"stopped (SIGINT). The keeper (pid {held.pid}) still holds tiny for the next daemon on "
        f"{run_dir}: `weight-cache serve` started again takes it over without loading. The "
        "keeper lets go after 600 s without a daemon, or now with `weight-cache keeper --stop "
        f"--run-dir {run_dir}`"
    )
    assert keeper_status(run_dir).models == ["tiny"]

    stopped = run_cli("keeper", "--stop", "--run-dir", str(run_dir), check=True)
    assert stopped.stdout == (
        f"stopped the keeper (pid {held.pid}) on {run_dir / 'keeper.sock'}; it let go of tiny\n"
    )
    assert keeper_status(run_dir) is None
    again = run_cli("keeper", "--stop", "--run-dir", str(run_dir), check=True)
    assert again.stdout == f"no keeper answers on {run_dir / 'keeper.sock'}\n"


def test_a_second_daemon_on_the_run_directory_is_told_about_run_dir(
    tmp_path: Path, tiny_fp8: Path, run_dir: Path
) -> None:
    first = serve(
        tmp_path, "first", "--model", str(tiny_fp8), "--run-dir", str(run_dir), "--keeper", "auto"
    )
    try:
        wait_for(lambda: first.answers("/ready"), timeout=60)
        second = serve(
            tmp_path, "second", "--model", str(tiny_fp8), "--run-dir", str(run_dir),
            "--keeper", "auto",
        )  # fmt: skip
        assert second.process.wait(60) == 1
        (line,) = [x for x in second.log.read_text().splitlines() if x.startswith("Error:")]
        assert f"[keeper_unavailable] the keeper on {run_dir / 'keeper.sock'} refused" in line
        assert "give this one a --run-dir of its own (WEIGHT_CACHE_RUN_DIR)" in line
        assert "--keeper auto" not in line  # what it already used
    finally:
        first.process.terminate()
        first.process.wait(30)


def test_status_fits_80_columns_and_prints_json(tmp_path: Path, tiny_fp8: Path) -> None:
    """Headers and a failure's reason whole on an 80-column terminal; --json as one object."""
    root = tmp_path / "models"
    bad = root / "a-model-id-long-enough-to-squeeze-the-table"
    bad.mkdir(parents=True)
    (bad / "config.json").write_text("{not json")
    daemon = start_daemon(tmp_path, [tiny_fp8], "--model-id", "tiny", "--allowed-root", str(root))
    try:
        httpx.post(f"{daemon.url}/v1/models", json={"path": str(bad)}).raise_for_status()
        wait_for(
            lambda: httpx.get(f"{daemon.url}/v1/models/{bad.name}").json()["state"] == "failed"
        )
        detail = httpx.get(f"{daemon.url}/v1/models/{bad.name}").json()["error"]["detail"]
        narrow = run_cli("status", "--url", daemon.url, env={"COLUMNS": "80"}, check=True).stdout
        for header in ("model", "state", "loaded", "resident", "leases", "parked", "quant"):
            assert f" {header} " in narrow, (header, narrow)
        assert f"{bad.name} failed: [invalid_config] {detail}" in narrow
        assert "keeper: off" in narrow
        assert max(len(line) for line in narrow.splitlines() if "│" in line) <= 80
        report = json.loads(run_cli("status", "--url", daemon.url, "--json", check=True).stdout)
        assert set(report) == {"inventory", "parked", "startup_slots"}
        states = {m["id"]: m["state"] for m in report["inventory"]["models"]}
        assert states == {"tiny": "ready", bad.name: "failed"}
        assert report["inventory"]["keeper"]["mode"] == "off"
    finally:
        daemon.stop()


@pytest.mark.parametrize("how", ["flag", "variable"])
def test_an_empty_model_means_no_model(tmp_path: Path, tiny_fp8: Path, how: str) -> None:
    """`--model ''` and `WEIGHT_CACHE_MODEL=` start a daemon with no model: not the demo model,
    not the current directory (a checkpoint here)."""
    for item in tiny_fp8.iterdir():  # the daemon's working directory holds a checkpoint
        (tmp_path / item.name).write_bytes(item.read_bytes())
    args = ("--model", "") if how == "flag" else ()
    env = {"WEIGHT_CACHE_MODEL": ""} if how == "variable" else {}
    daemon = serve(tmp_path, "daemon", *args, "--keeper", "off", env=env)
    try:
        wait_for(daemon.answers, timeout=60)
        assert httpx.get(f"{daemon.url}/v1/models").json() == []
        ready = httpx.get(f"{daemon.url}/ready").json()
        assert ready["reason"].startswith("no model is loaded")
    finally:
        daemon.process.terminate()
        assert daemon.process.wait(30) == 0
    assert "loading" not in daemon.log.read_text()
    assert not (tmp_path / "cache" / "demo").exists()
