"""vLLM's default loader (``load_format="auto"``) timed by vLLM itself: a fresh process builds an
engine and its "Model loading took X GiB memory and Y seconds" line is read from the log.

A fresh process, so what the daemon's loads left in this one (its allocator, its CUDA context)
neither helps nor hurts it; the engine is stopped once the line is there, the rest of its
start-up being no load.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.measure import log
from harness.waiting import poll

VLLM_LINE = re.compile(r"Model loading took ([\d.]+) GiB(?: memory)? and ([\d.]+) s")

VLLM_CODE = """
import sys, vllm
vllm.LLM(model=sys.argv[1], load_format="auto", enforce_eager=True, skip_tokenizer_init=True,
         gpu_memory_utilization=float(sys.argv[2]), max_model_len=1024, max_num_seqs=8, seed=0)
print("weight-cache bench: vLLM engine built", flush=True)
"""


def vllm_env(site: str | None) -> dict[str, str] | None:
    """The environment vLLM runs in: this one if it imports vllm, else ``site`` (or the H200
    recipe's /tmp/site) on PYTHONPATH if vllm is there; None when vLLM is nowhere."""
    env = dict(os.environ)
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_USE_FLASHINFER_SAMPLER=os.environ.get("VLLM_USE_FLASHINFER_SAMPLER", "0"),
        VLLM_NO_USAGE_STATS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK="1",
        PYTHONUNBUFFERED="1",
    )
    if site is None and importlib.util.find_spec("vllm") is not None:
        return env
    candidates = [site] if site else ["/tmp/site"]
    for candidate in candidates:
        if candidate and (Path(candidate) / "vllm" / "__init__.py").is_file():
            env["PYTHONPATH"] = os.pathsep.join([candidate, os.getcwd()])
            return env
    return None


def vllm_load(path: Path, site: str | None, timeout_s: float, memory: float) -> dict[str, Any]:
    """vLLM's own figure for its default loader, read from its log as it comes; the engine is
    stopped once the line is there (the rest of its start-up is not a load)."""
    env = vllm_env(site)
    if env is None:
        return {"skipped": "vLLM is not importable here (give --vllm-site DIR holding vllm/)"}
    log("vLLM's default loader (fresh process, load_format='auto') ...")
    proc = subprocess.Popen(
        [sys.executable, "-c", VLLM_CODE, str(path), str(memory)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    poll(
        lambda: VLLM_LINE.search("".join(lines[-50:])),
        timeout_s,
        every=0.2,
        while_=lambda: proc.poll() is None,
    )
    timed_out = time.monotonic() >= deadline
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    reader.join(10)
    text = "".join(lines)
    found = VLLM_LINE.findall(text)
    if not found:
        ended = "timed out" if timed_out else f"exit {proc.returncode}"
        return {"error": f"no 'Model loading took' line ({ended})", "tail": text[-3000:]}
    gib, seconds = found[-1]
    return {"seconds": float(seconds), "gib": float(gib)}
