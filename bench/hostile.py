"""``/health`` while the daemon is attacked: one row per hostile case, with what was tried, what
held, ``/health`` p50/p99/max sampled every 10 ms on a connection opened beforehand, and the
daemon's resident memory before the case, at its peak during it, and once it ended.

A daemon process serves the qwen2.5-0.5b demo model with its default limits (256 connections,
32 KiB of headers, 10 s to send a request, 4096 leases, 1024 per user, 256 per client, 64 models,
4 loads at once) and one allowed root. Each case is bounded in count and time and talks to
127.0.0.1 only. Targets: ``/health`` p99 at most 50 ms during every case on a 2-core machine,
and RSS back within 50 MB of its start once the case ends.

``--tree DIR`` runs the daemon of another source tree (``git archive <commit> | tar -x -C DIR``)
under the same cases, for before/after figures; cases that need settings it lacks are skipped.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench import hostile_files, hostile_front, hostile_handles, hostile_leases
from bench.common import CACHE, demo_checkpoint, save_json
from bench.hostile_tools import Case, Target
from harness.daemon_process import start_daemon
from harness.hostile.memory import SLACK_BYTES
from harness.hostile.probe import HealthProbe
from harness.hostile.users import NOBODY
from harness.waiting import poll


def idle(target: Target, work: Path) -> tuple[int, int, str]:
    time.sleep(2)
    return 0, 0, "baseline"


def token_file_of_another_user(target: Target, work: Path) -> tuple[int, int, str]:
    """``serve --token-file`` naming a 0600 file another user owns (that user knows the
    token): the daemon must refuse to start (it served with it)."""
    token = work / "foreign-token"
    token.write_text("a-token-another-user-wrote-0123456789\n")
    token.chmod(0o600)
    os.chown(token, NOBODY, NOBODY)
    serve = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "weight_cache_cli",
            "serve",
            "--device",
            "cpu",
            "--port",
            "0",
            "--token-file",
            str(token),
            "--keeper",
            "off",
        ],
        cwd=target.tree,
        env={**os.environ, **({"PYTHONPATH": str(target.tree)} if target.tree else {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = serve.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        serve.kill()
        out, _ = serve.communicate()
        return 1, 0, "served with it"
    said = next((line for line in out.splitlines() if "token" in line.lower()), out[-200:])
    return 1, int(serve.returncode != 0), f"exit {serve.returncode}: {said.strip()[:160]}"


CASES: dict[str, Case] = {
    "idle": idle,
    "FIFO as model.safetensors": hostile_files.fifo,
    "one 100 MB header": hostile_front.one_header,
    "four 100 MB headers": hostile_front.four_headers,
    "200 MB chunked trailer": hostile_front.trailers,
    "200 half-sent requests": hostile_front.slowloris,
    "5,000 connections": hostile_front.connection_flood,
    "20 pipelining, never reading": hostile_front.pipelined_unread,
    "300 idle connections at the cap": hostile_front.idle_at_cap,
    "100,000-file directory": hostile_files.many_files,
    "num_hidden_layers 1,000,000": hostile_files.lying_config,
    "config.json 100,000 deep": hostile_files.deep_config,
    "400,000 layers, one empty tensor": hostile_files.layer_lie,
    "59 MiB header, 1.14 M entries": hostile_files.header_bomb,
    "200,000-entry header": hostile_files.entry_bomb,
    "symlink swap race": hostile_files.symlink_race,
    "non-UTF-8 checkpoint name": hostile_files.odd_name,
    "300 loads at once": hostile_files.load_flood,
    "60,000 one-tensor layers, 4 loads at once for 30 s": hostile_files.many_layers_storm,
    "9,000 hollow layers, 4 loads at once for 30 s": hostile_files.hollow_layers_storm,
    "1-byte chunks, one allowed connection": hostile_front.tiny_chunks,
    "1-byte chunks, 16 connections of a refused user": hostile_front.tiny_chunks_refused_user,
    "1,000 connections of one allowed user": hostile_front.allowed_flood,
    "300 busy keep-alive connections of one allowed user": hostile_front.busy_keep_alive,
    "token file owned by another user": token_file_of_another_user,
    "20,000 leases, default caps": hostile_leases.leases_capped,
    "4,096 leases, invisible PIDs": hostile_leases.invisible_pids,
    "another user's lease": hostile_leases.foreign_lease,
}


def _probe_main(url: str, stop: Any, out: Any) -> None:
    with HealthProbe(url, min_samples=20) as probe:
        out.put("connected")
        stop.wait(3600)
    out.put((probe.samples, probe.failures))


class ProbeProcess:
    """A :class:`HealthProbe` in a process of its own, so the attacking code in this process
    (threads swapping files, sockets by the thousand) does not slow the probe's own client."""

    def __init__(self, url: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._out = ctx.Queue()
        self._proc = ctx.Process(target=_probe_main, args=(url, self._stop, self._out))
        self.probe = HealthProbe(url)

    def __enter__(self) -> HealthProbe:
        self._proc.start()
        assert self._out.get(timeout=120) == "connected"  # before the case starts
        return self.probe

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.probe.samples, self.probe.failures = self._out.get(timeout=120)
        self._proc.join(30)


class RssWatch:
    """The daemon's RSS before a case, its peak during it (sampled every 20 ms), and after it:
    waited for (up to 30 s) to come back within the slack of its start."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.before = self.peak = self.after = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(0.02):
            self.peak = max(self.peak, self.target.rss_mb())

    def __enter__(self) -> RssWatch:
        self.before = self.peak = self.target.rss_mb()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        slack = SLACK_BYTES / 2**20
        poll(lambda: self.target.rss_mb() <= self.before + slack, 30, every=0.2)
        self.after = self.target.rss_mb()


def _row(
    name: str, probe: HealthProbe, rss: RssWatch, tried: int, held: int, what: str
) -> dict[str, Any]:
    return {
        "case": name,
        "tried": tried,
        "held": held,
        "what": what,
        "health_n": len(probe.samples),
        "health_failures": len(probe.failures),
        "failures": sorted(set(probe.failures))[:3],
        "p50_ms": probe.p50 * 1e3,
        "p99_ms": probe.p99 * 1e3,
        "max_ms": probe.max * 1e3,
        "rss_before_mb": rss.before,
        "rss_peak_mb": rss.peak,
        "rss_after_mb": rss.after,
    }


# What a case needs made before it is measured (the attacker's own work).
PREPARE = {
    "59 MiB header, 1.14 M entries": hostile_files.prepare_bombs,
    "200,000-entry header": hostile_files.prepare_bombs,
}


def _run_case(name: str, case: Case, target: Target, work: Path) -> dict[str, Any]:
    if name in PREPARE:
        PREPARE[name](target, work)
    with RssWatch(target) as rss, ProbeProcess(target.url) as probe:
        try:
            tried, held, what = case(target, work)
        except Exception as exc:  # a case the daemon under test breaks is a finding
            tried, held, what = 0, 0, f"case failed: {type(exc).__name__}: {exc}"[:200]
    return _row(name, probe, rss, tried, held, what)


def leases_case(model: Path, work: Path, tree: Path | None) -> dict[str, Any]:
    caps = ["--max-leases", "30000", "--max-leases-per-client", "30000"]
    if tree is None:
        caps += ["--max-leases-per-uid", "30000"]
    daemon = start_daemon(
        work / "leases", [model], "--model-id", "qwen", *caps, timeout_s=600, tree=tree
    )
    try:
        target = Target(daemon, model, tree is None, tree)
        return _run_case("20,000 leases + reaper", hostile_leases.leases_20k, target, work)
    finally:
        daemon.stop()


def scrub_case(model: Path, work: Path, tree: Path | None) -> dict[str, Any]:
    """A daemon scrubbing the qwen arena (~0.6 GB) every second, /health polled for 6 s."""
    daemon = start_daemon(
        work / "scrub",
        [model],
        "--model-id",
        "qwen",
        "--scrub-interval",
        "1",
        timeout_s=600,
        tree=tree,
    )
    try:
        target = Target(daemon, model, tree is None, tree)

        def scrub(target: Target, work: Path) -> tuple[int, int, str]:
            time.sleep(6)
            scrubs = [
                line
                for line in httpx.get(f"{target.url}/metrics").text.splitlines()
                if line.startswith("weight_cache_scrubs_total")
            ]
            return 1, 1, scrubs[0] if scrubs else ""

        return _run_case("scrub every 1 s (qwen arena)", scrub, target, work)
    finally:
        daemon.stop()


def own_daemon_case(
    name: str,
    case: Case,
    model: Path,
    work: Path,
    tree: Path | None,
    *flags: str,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """``case`` against a daemon of its own serving qwen with ``flags`` and ``env``, its run
    directory where every user can reach it (its own mode decides who enters)."""
    reachable = Path(tempfile.mkdtemp(prefix="wc-hostile-run-"))
    reachable.chmod(0o755)
    daemon = start_daemon(
        work / name.split(maxsplit=1)[0],
        [model],
        "--model-id",
        "qwen",
        *flags,
        env=env,
        timeout_s=600,
        tree=tree,
        run_dir=reachable / "run",
    )
    try:
        return _run_case(name, case, Target(daemon, model, tree is None, tree), work)
    finally:
        daemon.stop()
        shutil.rmtree(reachable, ignore_errors=True)


# Cases that need a daemon of their own: (name, case, flags, environment).
OWN_DAEMON: list[tuple[str, Case, tuple[str, ...], dict[str, str]]] = [
    (
        "1-byte chunks, 16 connections without the token",
        hostile_front.tiny_chunks_without_token,
        (),
        {"WEIGHT_CACHE_TOKEN": "a-token-the-attacker-lacks-0123456789"},
    ),
    (
        "handle socket: 70 connections trickling",
        hostile_handles.trickled,
        ("--shm-group", str(NOBODY)),
        {},
    ),
]


def _print(rows: list[dict[str, Any]]) -> None:
    print(
        f"\n{'case':<34}{'tried':>7}{'held':>7}{'n':>6}{'p50 ms':>8}{'p99 ms':>8}{'max ms':>8}"
        f"{'RSS MB before/peak/after':>26}"
    )
    for r in rows:
        rss = f"{r['rss_before_mb']:.0f}/{r['rss_peak_mb']:.0f}/{r['rss_after_mb']:.0f}"
        print(
            f"{r['case']:<34}{r['tried']:>7}{r['held']:>7}{r['health_n']:>6}"
            f"{r['p50_ms']:>8.1f}{r['p99_ms']:>8.1f}{r['max_ms']:>8.1f}{rss:>26}"
            + (f"  {r['health_failures']} /health failures" if r["health_failures"] else "")
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", nargs="*", help="case names to run (default: all)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--tree", type=Path, help="serve the daemon of this source tree")
    args = parser.parse_args()
    model = demo_checkpoint("qwen2.5-0.5b")
    work = CACHE / "hostile-bench"
    allowed = work / "allowed"
    allowed.mkdir(parents=True, exist_ok=True)
    daemon = start_daemon(
        work,
        [model],
        "--model-id",
        "qwen",
        "--allowed-root",
        str(allowed),
        timeout_s=600,
        tree=args.tree,
    )
    target = Target(daemon, model, args.tree is None, args.tree)
    rows = []
    try:
        for name, case in CASES.items():
            if args.only and name not in args.only:
                continue
            rows.append(_run_case(name, case, target, allowed))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        daemon.stop()
    if not args.only or "leases" in args.only:
        rows.append(leases_case(model, work, args.tree))
        print(json.dumps(rows[-1]), flush=True)
    if not args.only or "scrub" in args.only:
        rows.append(scrub_case(model, work, args.tree))
    for name, case, flags, env in OWN_DAEMON:
        if not args.only or name in args.only:
            rows.append(own_daemon_case(name, case, model, work, args.tree, *flags, env=env))
            print(json.dumps(rows[-1]), flush=True)
    _print(rows)
    save_json(args.json, rows)


if __name__ == "__main__":
    main()
