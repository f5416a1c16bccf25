"""``vllm serve`` as a user runs it (the OpenAI server, EngineCore in its own process, CUDA
graphs and torch.compile on), started as a logged process and timed from its start to
``/health`` and to its first answer.

vLLM may be installed without its ``vllm`` command (carried onto a machine on ``PYTHONPATH``), so
the command is its CLI's ``main`` under this Python.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from harness.waiting import poll
from protocol.processes import process_tree
from tests.gpu.completions import SERVED_MODEL_NAME, Answer, complete
from tests.gpu.gpu_memory import held_by
from tests.gpu.processes import LoggedProcess
from tests.gpu.vllm_logs import process_pids, serve_phases

VLLM_MAIN = "import sys; from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; main()"


def serve_environment(base: Mapping[str, str]) -> dict[str, str]:
    """What ``vllm serve`` needs on the H200 image, over ``base``: no flashinfer (greedy sampling
    never uses it), cuDNN's version check off (torch 2.14 carried over the image's cuDNN), no
    usage reports, unbuffered plain output (the proof stamps each line as it comes)."""
    env = dict(base)
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env.setdefault("PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK", "1")
    env.update(PYTHONUNBUFFERED="1", VLLM_NO_USAGE_STATS="1", NO_COLOR="1")
    return env


def loader_config(daemon_url: str, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``--model-loader-extra-config`` of an engine that must attach (no fallback)."""
    return {"url": daemon_url, "fallback": False, **(extra or {})}


def vllm_serve_argv(
    checkpoint: Path,
    port: int,
    load_format: str,
    *,
    loader: Mapping[str, Any] | None = None,
    gpu_memory_utilization: float = 0.3,
    max_model_len: int = 1024,
    max_num_seqs: int = 8,
    extra_args: Sequence[str] = (),
) -> list[str]:
    argv = [sys.executable, "-c", VLLM_MAIN, "serve", str(checkpoint)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_MODEL_NAME]
    argv += ["--skip-tokenizer-init", "--seed", "0", "--disable-uvicorn-access-log"]
    argv += ["--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs)]
    argv += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    argv += ["--load-format", load_format]
    if loader is not None:
        argv += ["--model-loader-extra-config", json.dumps(dict(loader))]
    return argv + list(extra_args)


class ServeEngine:
    """One ``vllm serve`` process (and its EngineCore), on ``port``."""

    def __init__(
        self, name: str, argv: Sequence[str], port: int, log_path: Path, env: Mapping[str, str]
    ) -> None:
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.process = LoggedProcess(name, argv, log_path, env=env)
        self.health_s: float | None = None

    def wait_health(self, timeout: float) -> float | None:
        """Seconds from the start to the first ``/health`` 200; None if the process ended or
        ``timeout`` passed first. (vLLM binds its port early but listens only once serving:
        until then a connection is refused at once.)"""
        with httpx.Client(base_url=self.url, timeout=5) as client:

            def healthy() -> bool:
                try:
                    return client.get("/health").status_code == 200
                except httpx.HTTPError:
                    return False

            if poll(healthy, timeout, every=0.02, while_=self.process.alive) is None:
                return None
        self.health_s = round(self.process.since_start(), 3)
        return self.health_s

    def ask(self, prompt: Sequence[int], timeout: float = 120) -> Answer:
        with httpx.Client(base_url=self.url, timeout=timeout) as client:
            return complete(client, prompt)

    def phases(self) -> dict[str, Any]:
        return serve_phases(self.process.lines())

    def roles(self) -> dict[str, list[int]]:
        """This engine's processes by vLLM's name for them (``APIServer``, ``EngineCore``; any
        other process of the tree as ``other``)."""
        named = {pid: name for name, pid in process_pids(self.process.lines()).items()}
        named.setdefault(self.process.pid, "APIServer")
        roles: dict[str, list[int]] = {}
        for pid in process_tree(self.process.pid):
            roles.setdefault(named.get(pid, "other"), []).append(pid)
        return roles

    def memory(self, used: Mapping[int, int]) -> dict[str, int]:
        """GPU bytes this engine's processes hold, per role, from a ``used_by_pid`` reading."""
        return held_by({f"{self.name}.{r}": pids for r, pids in self.roles().items()}, used)

    def kill(self) -> float:
        """``kill -9`` of the whole engine (API server and EngineCore); the monotonic time."""
        moment = time.monotonic()
        self.process.signal(signal.SIGKILL)
        return moment

    def stop(self, grace_s: float = 15) -> None:
        self.process.stop(grace_s)
