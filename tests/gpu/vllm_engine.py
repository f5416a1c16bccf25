"""One vLLM 0.33 engine in this process: build ``vllm.LLM`` on a checkpoint with a load format,
generate greedily from fixed token ids, optionally record the model's whole state, and print one
``RESULT {json}`` line. ``vllm_engine_proof`` runs many of these, each in its own process.

usage: python -m tests.gpu.vllm_engine CKPT --load-format auto|weight_cache [--url URL]
       [--fallback true|false] [--kv-cache-dtype auto|fp8] [--cuda-graphs] [--state FILE]
       [--sleep-mode] [--gpu-memory]

``--gpu-memory`` adds the GPU bytes this process holds once it generated (NVML, as
``gpu_memory`` reads them; the engine runs in this process with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

PROMPTS = [
    [151, 2048, 9000, 17, 4242, 100, 31337, 77, 5, 1234, 999, 65000],
    [42, 43, 44, 45, 46, 47, 48, 49],
    [120000, 3, 151000, 8888, 256, 1024, 2, 7777, 60606, 11, 22, 33, 44, 55, 66, 77],
]
MAX_TOKENS = 32


def state_of(model: Any) -> dict[str, Any]:
    """The model's whole state (see ``tests.vllm.model_state``) and, per parameter, whether
    its memory belongs to this process's CUDA allocator (leased tensors do not)."""
    import torch

    from tests.vllm.model_state import model_state

    state = model_state(model)
    segments = [
        (s["address"], s["address"] + s["total_size"]) for s in torch.cuda.memory_snapshot()
    ]
    own = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        ptr = param.data_ptr()
        own[name] = any(lo <= ptr < hi for lo, hi in segments)
    return {
        "tensors": {k: list(v) for k, v in state.tensors.items()},
        "aliases": state.aliases,
        "attributes": state.attributes,
        "in_engine_allocator": own,
    }


def _show_project_logs() -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s"))
    for name in ("engine_client", "protocol", "service"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)
        logger.propagate = False


def run(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"ok": False}
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    options: dict[str, Any] = {
        "model": args.ckpt,
        "enforce_eager": not args.cuda_graphs,
        "skip_tokenizer_init": True,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "kv_cache_memory_bytes": args.kv_cache_bytes,
        "max_model_len": 1024,
        "max_num_seqs": 8,
        "seed": 0,
        "load_format": args.load_format,
        "kv_cache_dtype": args.kv_cache_dtype,
        "enable_sleep_mode": args.sleep_mode,
    }
    if args.load_format == "weight_cache":
        extra: dict[str, Any] = {"url": args.url}
        if args.fallback is not None:
            extra["fallback"] = args.fallback == "true"
        options["model_loader_extra_config"] = extra
    start = time.perf_counter()
    llm = LLM(**options)
    result["engine_start_s"] = round(time.perf_counter() - start, 2)
    if args.state:
        states = llm.apply_model(state_of)
        Path(args.state).write_text(json.dumps(states[0]))
    vocab = json.loads(Path(args.ckpt, "config.json").read_text())["vocab_size"]
    prompts = [TokensPrompt(prompt_token_ids=[i % vocab for i in ids]) for ids in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, detokenize=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    result["generate_s"] = round(time.perf_counter() - start, 3)
    result["tokens"] = [list(o.outputs[0].token_ids) for o in outputs]
    if args.gpu_memory:
        from tests.gpu.gpu_memory import used_by_pid

        used = used_by_pid()
        result["gpu_bytes"] = None if used is None else used.get(os.getpid(), 0)
    result["ok"] = True
    return result


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("ckpt")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--url")
    p.add_argument("--fallback", choices=["true", "false"])
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--cuda-graphs", action="store_true")
    p.add_argument("--state")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    p.add_argument("--sleep-mode", action="store_true", help="vLLM's --enable-sleep-mode")
    p.add_argument("--gpu-memory", action="store_true")
    args = p.parse_args()
    _show_project_logs()
    try:
        result = run(args)
    except BaseException as exc:
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        traceback.print_exc()
    result["multiprocessing"] = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    result["pid"] = os.getpid()
    sys.stdout.flush()
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
