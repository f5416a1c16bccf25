"""``weight-cache serve`` as an operator runs it: it binds before it loads, fails in one line
with a non-zero status, logs in one format at one level, and ``--help`` needs no torch."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx

from harness.cli import CLI, run_cli
from harness.daemon_process import free_port, start_daemon
from harness.python_child import run_python
from harness.waiting import wait_for


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("Error:")]


def test_help_imports_neither_torch_nor_fastapi() -> None:
    code = """
import sys
from click.testing import CliRunner
from weight_cache_cli import cli
for args in (["--help"], ["serve", "--help"], ["status", "--help"], ["attach", "--help"],
             ["demo-checkpoint", "--help"], ["openapi", "--help"]):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, (args, result.output)
heavy = sorted(m for m in ("torch", "fastapi", "uvicorn", "starlette") if m in sys.modules)
print(" ".join(heavy))
"""
    out = run_python(code)
    assert out.stdout.strip() == "", f"imported for --help: {out.stdout}"


def test_demo_choices_match_the_generator() -> None:
    from service import demo
    from weight_cache_cli import demo as command

    assert set(command.SHAPES) == set(demo.SHAPES) and set(command.SCHEMES) == set(demo.SCHEMES)


def test_a_taken_port_fails_before_any_load(tmp_path: Path, tiny_fp8: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = run_cli(
            "serve", "--model", str(tiny_fp8), "--port", str(port), "--device", "cpu",
            "--shm-dir", str(tmp_path),
        )  # fmt: skip
    assert out.returncode == 1
    assert error_lines(out.stderr) == [
        f"Error: cannot listen on 127.0.0.1:{port}: the address is in use (another weight-cache "
        "daemon?); stop it, or choose another --port / WEIGHT_CACHE_PORT"
    ]
    assert "loading" not in out.stderr and "Traceback" not in out.stderr


def test_a_failed_startup_model_exits_non_zero(tmp_path: Path, tiny_fp8: Path, copy_of) -> None:
    broken = copy_of(tiny_fp8)
    (broken / "model.safetensors").write_bytes(b"\0" * 16)
    out = run_cli(
        "serve", "--model", str(broken), "--port", str(free_port()), "--device", "cpu",
        "--shm-dir", str(tmp_path),
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    (line,) = error_lines(out.stderr)
    assert line.startswith(f"Error: startup model '{broken.name}' failed to load: [")
    assert line.endswith("Pass --keep-going to serve the other models anyway")
    assert "Traceback" not in out.stderr and "internal_error" not in out.stderr


def test_keep_going_serves_the_rest(tmp_path: Path, tiny_fp8: Path, copy_of) -> None:
    broken = copy_of(tiny_fp8)
    (broken / "config.json").write_text("{}")
    daemon = start_daemon(tmp_path, [tiny_fp8, broken], "--model-id", "tiny", "--keep-going")
    try:
        ready = httpx.get(f"{daemon.url}/ready").json()
        assert ready["ready"] is True and ready["models"] == {
            "tiny": "ready",
            broken.name: "failed",
        }
    finally:
        daemon.stop()


def test_bad_settings_are_one_line_and_status_2(tmp_path: Path) -> None:
    cases = [
        (["serve", "--shm-dir", str(tmp_path / "missing")], {}, "--shm-dir"),
        (["serve", "--allowed-root", str(tmp_path / "missing")], {}, "--allowed-root"),
        (["serve"], {"WEIGHT_CACHE_SHM_DIRR": "/dev/shm"}, "WEIGHT_CACHE_SHM_DIR?"),
        (["serve", "--model", "org/absent"], {"HF_HOME": str(tmp_path)}, "huggingface-cli"),
        (["serve", "--memory-budget", "lots"], {}, "--memory-budget"),
    ]
    for args, env, expected in cases:
        out = run_cli(*args, env=env)
        assert out.returncode == 2, (args, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert out.stderr.startswith("Error: ") and expected in out.stderr, out.stderr


def test_a_repo_id_and_a_relative_path_serve_as_absolute_paths(
    tmp_path: Path, tiny_fp8: Path
) -> None:
    from harness.checkpoint_tools import hub_snapshot

    snapshot = hub_snapshot(tmp_path / "hf" / "hub", "acme/tiny-fp8")
    for item in tiny_fp8.iterdir():
        (snapshot / item.name).write_bytes(item.read_bytes())
    daemon = start_daemon(
        tmp_path,
        [Path("acme/tiny-fp8")],
        "--model-id",
        "tiny",
        env={"HF_HOME": str(tmp_path / "hf")},
    )
    try:
        (model,) = httpx.get(f"{daemon.url}/v1/models").json()
        assert model["state"] == "ready" and model["path"] == str(snapshot.resolve())
    finally:
        daemon.stop()


@contextlib.contextmanager
def serving(args: list[str], log: Path, port: int) -> Iterator[str]:
    """``weight-cache serve`` with its output in ``log``, until it is ready; yields its URL."""
    with log.open("w") as sink:
        process = subprocess.Popen(args, stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{url}/ready").status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(ready, timeout=60)
        yield url
    finally:
        process.terminate()
        process.wait(30)


def test_log_level_and_json_format_govern_uvicorn_too(tmp_path: Path, tiny_fp8: Path) -> None:
    port = free_port()
    log = tmp_path / "log"
    args = [
        *CLI, "--log-level", "info", "--log-format", "json", "serve", "--model", str(tiny_fp8),
        "--model-id", "tiny", "--port", str(port), "--device", "cpu", "--shm-dir", str(tmp_path),
    ]  # fmt: skip
    with serving(args, log, port) as url:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:  # as sent
            raw.sendall(b"GET /v1/models/%1B[31mforged%07 HTTP/1.1\r\nHost: x\r\n\r\n")
            assert raw.recv(100).startswith(b"HTTP/1.1 422")
        assert httpx.post(f"{url}/v1/leases", content=b"x" * 100_000).status_code == 413
    records = [json.loads(line) for line in log.read_text().splitlines()]
    loggers = {r["logger"] for r in records}
    assert "uvicorn.error" in loggers and "service.daemon" in loggers
    refused = [r["message"] for r in records if r["message"].startswith("refused ")]
    # the client's control characters are escaped in the message itself, never logged raw
    assert "refused GET /v1/models/\\x1b[31mforged\\x07: 422 invalid_request" in " ".join(refused)
    assert "\x1b" not in log.read_text() and "\\u001b" not in log.read_text()
    assert any(m.startswith("refused POST /v1/leases: 413 payload_too_large") for m in refused)


def test_log_level_warning_silences_uvicorn_and_text_escapes_controls(
    tmp_path: Path, tiny_fp8: Path
) -> None:
    port = free_port()
    log = tmp_path / "log"
    args = [
        *CLI, "--log-level", "warning", "serve", "--model", str(tiny_fp8), "--model-id", "tiny",
        "--port", str(port), "--device", "cpu", "--shm-dir", str(tmp_path),
    ]  # fmt: skip
    with serving(args, log, port):
        pass
    assert log.read_text() == ""  # no INFO line from anyone, uvicorn included

    import io
    import logging

    from service.logs import configure_logging

    stream = io.StringIO()
    configure_logging("INFO", "text", stream)
    try:
        logging.getLogger("uvicorn.error").info("started")
        logging.getLogger("service.test").info("path %s", "/a\nWARNING forged\x1b[31m")
    finally:
        configure_logging("WARNING", "text", sys.stderr)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].endswith("INFO uvicorn.error: started")
    assert lines[1].endswith("INFO service.test: path /a\\nWARNING forged\\x1b[31m")


def test_a_stop_signal_sent_while_starting_is_not_lost(tmp_path: Path, tiny_fp8: Path) -> None:
    """A SIGTERM that came before uvicorn took over (caught meanwhile, so that the socket file
    is removed at exit) stops the daemon before it serves, instead of being dropped."""
    code = f"""
import signal, socket
from weight_cache_cli.serve import _run, build_settings
settings = build_settings(models=[{str(tiny_fp8)!r}], device="cpu", shm_dir={str(tmp_path)!r},
                          port=0, keeper="off", run_dir={str(tmp_path / "run")!r})
listener = socket.create_server(("127.0.0.1", 0))
daemon = _run(settings, listener, [signal.SIGTERM])
print("returned without serving:", daemon.models.records == {{}})
"""
    out = run_python(code, timeout=60)
    assert "returned without serving: True" in out.stdout
