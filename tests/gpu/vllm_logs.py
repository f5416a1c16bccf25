"""What vLLM 0.33's own log lines say about an engine's start: the figures it prints ("Model
loading took", "init engine ... took", graph capture, KV cache) and, with the proof's stamps
(``tests.gpu.processes.Line``), when each phase ended. Both GPU proofs parse logs here.

The patterns follow vLLM 0.33's messages (``GPUModelRunner.load_model``,
``EngineCore._initialize_kv_caches``, ``Worker.determine_available_memory``,
``GPUModelRunner.capture_model``, ``BaseModelLoader.load_model``) and its log format
``(PROCESS pid=N) LEVEL MM-DD HH:MM:SS [file:line] message``; ``tests/vllm`` checks that vLLM
still holds these messages.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from tests.gpu.processes import Line

LOADING = re.compile(r"Model loading took ([\d.]+) GiB memory and ([\d.]+) seconds")
INITIALIZING = re.compile(r"Initializing model took ([\d.]+) seconds")
STEPS = re.compile(r"steps inside vLLM: (.*)$")
PROCESS = re.compile(r"^\((\w+) pid=(\d+)\)")
LOAD_START = re.compile(r"Starting to load model")
INIT_ENGINE = re.compile(
    r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"
    r"(?: \(compilation: ([\d.]+) s)?"
)
KV_CACHE = re.compile(r"Available KV cache memory: ([\d.]+) GiB")
GRAPHS = re.compile(r"Graph capturing finished in ([\d.]+) secs, took ([\d.-]+) GiB")
COMPILE = re.compile(r"torch\.compile took ([\d.]+) s in total")
SERVER_START = re.compile(r"Starting vLLM server on")
WEIGHT_CACHE = "weight-cache"

# vLLM's message -> the phase it ends, in the order an engine starts.
PHASE_ENDS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("load_start", LOAD_START),
    ("model_loaded", LOADING),
    ("kv_cache_sized", KV_CACHE),
    ("graphs_captured", GRAPHS),
    ("engine_initialized", INIT_ENGINE),
    ("server_starting", SERVER_START),
)


def loading_figures(text: str) -> dict[str, Any]:
    """vLLM's own load figures in one engine's output: the last "Model loading took" (GiB, s),
    "Initializing model took" (s), the loader's step line, and the loader's first log lines."""
    figures: dict[str, Any] = {}
    loading = LOADING.findall(text)
    if loading:
        figures["model_loading_gib"] = float(loading[-1][0])
        figures["model_loading_s"] = float(loading[-1][1])
    initializing = INITIALIZING.findall(text)
    if initializing:
        figures["initializing_s"] = float(initializing[-1])
    steps = [m.group(1) for m in map(STEPS.search, text.splitlines()) if m]
    if steps:
        figures["loader_steps"] = steps[-1]
    figures["weight_cache_log"] = [
        line.strip()[-300:] for line in text.splitlines() if WEIGHT_CACHE in line
    ][:8]
    return figures


def process_pids(lines: Iterable[Line]) -> dict[str, int]:
    """vLLM's process names and their pids, as its log lines name them (``APIServer``,
    ``EngineCore``, ...): the first pid seen for each name."""
    pids: dict[str, int] = {}
    for line in lines:
        m = PROCESS.match(line.text)
        if m:
            pids.setdefault(m.group(1), int(m.group(2)))
    return pids


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def serve_phases(lines: list[Line]) -> dict[str, Any]:
    """A ``vllm serve`` start read from its stamped lines: when (seconds after the process
    started) its first line came (a warning of an import, often), the API server's and the
    EngineCore's first lines, and the end of each phase in ``PHASE_ENDS``; and the figures vLLM
    prints (GiB and seconds)."""
    at: dict[str, float | None] = {"first_line": lines[0].t if lines else None}
    for name, tag in (("api_server", "(APIServer"), ("engine_core", "(EngineCore")):
        at[f"{name}_first_line"] = next((x.t for x in lines if x.text.startswith(tag)), None)
    for phase, pattern in PHASE_ENDS:
        at[phase] = next((line.t for line in lines if pattern.search(line.text)), None)
    text = "\n".join(line.text for line in lines)
    phases: dict[str, Any] = {"at_s": {k: _rounded(v) for k, v in at.items()}}
    phases.update(loading_figures(text))
    if m := INIT_ENGINE.search(text):
        phases["init_engine_s"] = float(m.group(1))
        phases["compilation_s"] = float(m.group(2)) if m.group(2) else 0.0
    if m := KV_CACHE.search(text):
        phases["kv_cache_gib"] = float(m.group(1))
    if m := GRAPHS.search(text):
        phases["graph_capture_s"] = float(m.group(1))
        phases["graph_gib"] = float(m.group(2))
    if m := COMPILE.search(text):
        phases["torch_compile_s"] = float(m.group(1))
    phases["pids"] = process_pids(lines)
    return phases
