"""The engine proof: real vLLM 0.33 engines on a GPU, each in its own process, per checkpoint
and KV-cache dtype:

* A: vLLM's default loader;
* B1, B2: ``--load-format weight_cache`` attached to one daemon, two fresh processes one after
  the other, fallback off;
* C: ``weight_cache`` with no daemon at its address, fallback on (vLLM's default loader again);

then one B run through vLLM's default multiprocessing (EngineCore in its own process) and one
pair A/B with CUDA graphs on, as ``vllm serve`` runs by default. It checks greedy token ids
equal across A, B1, B2 and C; the model state of B1, B2 and C equal to A's
(``tests.vllm.model_state``); every leased parameter outside the engine's own CUDA allocator;
and, with ``--timing``, vLLM's own "Model loading took" for A and B on a quiet GPU.

Writes ``summary.json`` (and the logs) to ``--out`` and exits 1 if any check failed.

usage: python -m tests.gpu.vllm_engine_proof --root DIR --out DIR [--shapes ...]
       [--schemes ...] [--kv auto fp8] [--parallel 8] [--budget-s 540] [--timing]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tarfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.gpu.daemon_runner import DaemonCommand, ServedDaemon
from tests.gpu.processes import LoggedProcess
from tests.gpu.vllm_logs import loading_figures

ENGINE_TIMEOUT_S = 360.0


@dataclass
class Run:
    tag: str
    combo: str
    ckpt: Path
    load_format: str
    kv: str
    url: str | None = None
    fallback: str | None = None
    multiprocessing: bool = False
    cuda_graphs: bool = False
    state: bool = True
    result: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.combo}.{self.tag}"


class Proof:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out)
        self.work = Path(args.work)
        self.logs = self.work / "logs"
        self.states = self.work / "states"
        for d in (self.out, self.logs, self.states):
            d.mkdir(parents=True, exist_ok=True)
        self.deadline = time.monotonic() + args.budget_s
        self.summary: dict[str, Any] = {"combos": {}, "runs": {}, "checks": []}
        self.lock = threading.Lock()
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_NO_USAGE_STATS="1")
        self.env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

    # --- bookkeeping ------------------------------------------------------------------------

    def left(self) -> float:
        return float(self.deadline - time.monotonic())

    def save(self) -> None:
        with self.lock:
            (self.out / "summary.json").write_text(json.dumps(self.summary, indent=1))

    def check(self, what: str, ok: bool, detail: object = None) -> None:
        with self.lock:
            self.summary["checks"].append({"check": what, "ok": ok, "detail": detail})
        print(f"{'PASS' if ok else 'FAIL'} {what}" + (f": {detail}" if detail else ""), flush=True)

    # --- checkpoints and daemon ---------------------------------------------------------------

    def checkpoints(self) -> dict[str, Path]:
        import torch

        from service.demo import write_demo_checkpoint

        device = "cuda" if torch.cuda.is_available() else "cpu"
        out = {}
        for shape in self.args.shapes:
            for scheme in self.args.schemes:
                path = Path(self.args.root) / f"{shape}-{scheme}"
                if not (path / "config.json").exists():
                    start = time.monotonic()
                    write_demo_checkpoint(path, scheme, shape, device=device)
                    print(f"wrote {path} in {time.monotonic() - start:.1f} s", flush=True)
                out[f"{shape}-{scheme}"] = path
        return out

    def start_daemon(self, ckpts: dict[str, Path]) -> ServedDaemon:
        command = DaemonCommand(
            self.args.port, self.args.device, self.work / "shm", list(ckpts.values())
        )
        daemon = ServedDaemon(command, self.logs, self.env)
        daemon.start()
        return daemon

    def wait_ready(self, daemon: ServedDaemon) -> bool:
        figures = daemon.wait_ready(max(0.0, self.left() - 60))
        if not figures["ready"]:
            self.summary["daemon"] = {"ready": False, "rc": figures.get("rc")}
            return False
        self.summary["daemon"] = {
            "ready_after_s": figures["ready_s"],
            "models": [
                {k: m.get(k) for k in ("id", "state", "load_seconds")} for m in figures["models"]
            ],
        }
        return True

    # --- engines ------------------------------------------------------------------------------

    def engine(self, run: Run) -> dict[str, Any]:
        if self.left() < 45:
            run.result = {"ok": False, "error": "skipped: out of time"}
            return run.result
        cmd = [sys.executable, "-m", "tests.gpu.vllm_engine", str(run.ckpt)]
        cmd += ["--load-format", run.load_format, "--kv-cache-dtype", run.kv]
        if run.url:
            cmd += ["--url", run.url]
        if run.fallback:
            cmd += ["--fallback", run.fallback]
        if run.cuda_graphs:
            cmd.append("--cuda-graphs")
        state = self.states / f"{run.name}.json"
        if run.state:
            cmd += ["--state", str(state)]
        env = dict(self.env, VLLM_ENABLE_V1_MULTIPROCESSING="1" if run.multiprocessing else "0")
        proc = LoggedProcess(run.name, cmd, self.logs / f"{run.name}.log", env=env)
        if proc.wait_exit(min(ENGINE_TIMEOUT_S, max(30.0, self.left() - 10))) is None:
            proc.signal(signal.SIGKILL)
        code = proc.stop()
        text = proc.text()
        result: dict[str, Any] = {"ok": False, "error": f"no RESULT line (rc {code})"}
        for line in text.splitlines():
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT ") :])
        result["wall_s"] = round(proc.since_start(), 1)
        result.update(loading_figures(text))
        if not result.get("ok"):
            result["tail"] = text.splitlines()[-25:]
        if run.state and state.exists():
            result["state_file"] = str(state)
        run.result = result
        with self.lock:
            self.summary["runs"][run.name] = {k: v for k, v in result.items() if k != "tokens"}
        self.save()
        print(
            f"{run.name}: ok={result.get('ok')} wall={result['wall_s']} s "
            f"loading={result.get('model_loading_gib')} GiB {result.get('model_loading_s')} s",
            flush=True,
        )
        return result

    # --- comparison ---------------------------------------------------------------------------

    def compare_states(self, combo: str, a: Run, other: Run) -> None:
        sa, so = a.result.get("state_file"), other.result.get("state_file")
        if not (sa and so):
            self.check(f"{combo}: state {other.tag} = A", False, "state missing")
            return
        from tests.vllm.model_state import ModelState

        def load(path: str) -> tuple[ModelState, dict[str, bool]]:
            raw = json.loads(Path(path).read_text())
            tensors = {k: tuple(v) for k, v in raw["tensors"].items()}
            return ModelState(tensors, raw["aliases"], raw["attributes"]), raw[
                "in_engine_allocator"
            ]

        state_a, _ = load(sa)
        state_o, own = load(so)
        diffs = state_a.differences(state_o)
        self.check(f"{combo}: state {other.tag} = A", not diffs, diffs[:8] or None)
        if other.load_format == "weight_cache" and other.fallback == "false":
            in_engine = sorted(n for n, mine in own.items() if mine)
            self.check(
                f"{combo}: {other.tag} holds no weight in its own allocator",
                not in_engine,
                in_engine[:8] or None,
            )

    def compare_combo(self, combo: str, runs: dict[str, Run]) -> None:
        a = runs["A"]
        tokens = {tag: r.result.get("tokens") for tag, r in runs.items()}
        summary = {tag: (t[0][:8] if t else None) for tag, t in tokens.items()}
        with self.lock:
            self.summary["combos"][combo] = {
                "first_tokens": summary,
                "loading": {
                    tag: [r.result.get("model_loading_gib"), r.result.get("model_loading_s")]
                    for tag, r in runs.items()
                },
            }
        for tag in ("B1", "B2", "C"):
            self.check(
                f"{combo}: tokens {tag} = A",
                bool(tokens[tag]) and tokens[tag] == tokens["A"],
                None if tokens[tag] == tokens["A"] else summary,
            )
            self.compare_states(combo, a, runs[tag])
        self.save()

    # --- the whole proof ----------------------------------------------------------------------

    def main(self) -> int:
        ckpts = self.checkpoints()
        daemon = self.start_daemon(ckpts)
        url = daemon.command.url
        dead = f"http://127.0.0.1:{self.args.port + 1}"  # nothing listens there
        combos: dict[str, dict[str, Run]] = {}
        for key, path in [] if self.args.timing_only else ckpts.items():
            for kv in self.args.kv:
                combo = f"{key}.kv-{kv}"
                combos[combo] = {
                    "A": Run("A", combo, path, "auto", kv),
                    "B1": Run("B1", combo, path, "weight_cache", kv, url, "false"),
                    "B2": Run("B2", combo, path, "weight_cache", kv, url, "false"),
                    "C": Run("C", combo, path, "weight_cache", kv, dead, "true"),
                }
        try:
            with ThreadPoolExecutor(self.args.parallel) as pool:
                # A and C need no daemon: they run while it loads.
                first: list[Future[dict[str, Any]]] = []
                for runs in combos.values():
                    first += [
                        pool.submit(self.engine, runs["A"]),
                        pool.submit(self.engine, runs["C"]),
                    ]
                ready = self.wait_ready(daemon)
                self.check("daemon ready with every checkpoint", ready, self.summary.get("daemon"))
                if ready:
                    pairs = [pool.submit(self.restart, runs) for runs in combos.values()]
                    for pair in pairs:
                        pair.result()
                for f in first:
                    f.result()
            for combo, runs in combos.items():
                self.compare_combo(combo, runs)
            if ready and combos and self.args.extras:
                self.extra_runs(combos, url)
            if ready and (self.args.timing or self.args.timing_only):
                self.timing(ckpts, url)
        finally:
            daemon.stop()
            self.pack_logs()
            self.save()
        failed = [c for c in self.summary["checks"] if not c["ok"]]
        print(
            f"{len(self.summary['checks']) - len(failed)} passed, {len(failed)} failed", flush=True
        )
        return 1 if failed or not self.summary["checks"] else 0

    def restart(self, runs: dict[str, Run]) -> None:
        """B1, then B2 in a fresh process once B1 has exited: an engine restart."""
        self.engine(runs["B1"])
        self.engine(runs["B2"])

    def extra_runs(self, combos: dict[str, dict[str, Run]], url: str) -> None:
        """vLLM's default multiprocessing, and CUDA graphs, on the first combo."""
        combo, runs = next(iter(combos.items()))
        path, kv = runs["A"].ckpt, runs["A"].kv
        mp = Run("B-mp", combo, path, "weight_cache", kv, url, "false", multiprocessing=True)
        mp.state = False
        graphs_a = Run("A-graphs", combo, path, "auto", kv, cuda_graphs=True, state=False)
        graphs_b = Run(
            "B-graphs", combo, path, "weight_cache", kv, url, "false", cuda_graphs=True, state=False
        )
        with ThreadPoolExecutor(3) as pool:
            for f in [pool.submit(self.engine, r) for r in (mp, graphs_a, graphs_b)]:
                f.result()
        a_tokens = runs["A"].result.get("tokens")
        self.check(
            f"{combo}: tokens B-mp (EngineCore process) = A",
            bool(mp.result.get("tokens")) and mp.result.get("tokens") == a_tokens,
        )
        self.check(
            f"{combo}: tokens B-graphs = A-graphs (CUDA graphs)",
            bool(graphs_b.result.get("tokens"))
            and graphs_b.result.get("tokens") == graphs_a.result.get("tokens"),
        )

    def timing(self, ckpts: dict[str, Path], url: str) -> None:
        """vLLM's own load figures for the largest checkpoint, one engine at a time."""
        key = next((k for k in ckpts if k.startswith("llama-8b")), next(iter(ckpts)))
        rows = {}
        results = {}
        for tag, fmt, fallback in (("A", "auto", None), ("B", "weight_cache", "false")):
            run = Run(f"timing-{tag}", key, ckpts[key], fmt, "auto", url if fallback else None)
            run.fallback, run.state = fallback, False
            results[tag] = self.engine(run)
            rows[tag] = [run.result.get("model_loading_gib"), run.result.get("model_loading_s")]
        timing: dict[str, Any] = {"checkpoint": key, "model_loading": rows}
        timing["engine_start_s"] = {t: r.get("engine_start_s") for t, r in results.items()}
        timing["initializing_s_A"] = results["A"].get("initializing_s")
        timing["loader_steps_B"] = results["B"].get("loader_steps")
        a_s, b_s, init = rows["A"][1], rows["B"][1], timing["initializing_s_A"]
        if a_s and b_s:
            timing["speedup"] = round(a_s / b_s, 1)
            timing["target_speedup_9x"] = a_s / b_s >= 9
        if b_s and init:
            timing["target_within_init_plus_100ms"] = b_s <= init + 0.1
        self.summary["timing"] = timing
        print(f"timing: {json.dumps(timing)}", flush=True)
        self.save()

    def pack_logs(self) -> None:
        with tarfile.open(self.out / "logs.tar.gz", "w:gz") as tar:
            tar.add(self.logs, arcname="logs")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True, help="checkpoints (written here if missing)")
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/vllm-engine-proof")
    p.add_argument("--shapes", nargs="+", default=["qwen2.5-0.5b", "llama-8b"])
    p.add_argument("--schemes", nargs="+", default=["fp8", "fp8-pc-pt"])
    p.add_argument("--kv", nargs="+", default=["auto", "fp8"])
    p.add_argument("--parallel", type=int, default=8)
    p.add_argument("--port", type=int, default=8471)
    p.add_argument("--device", default="cuda:0", help="the daemon's device")
    p.add_argument("--budget-s", type=float, default=540)
    p.add_argument("--timing", action="store_true")
    p.add_argument("--no-extras", dest="extras", action="store_false", help="skip B-mp, graphs")
    p.add_argument("--timing-only", action="store_true", help="only the quiet load figures")
    return Proof(p.parse_args()).main()


if __name__ == "__main__":
    sys.exit(main())
