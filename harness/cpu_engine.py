"""One vLLM 0.33 engine on vLLM's CPU platform, greedy on a fixed prompt, in this process (run as
a script: ``python -m harness.cpu_engine CHECKPOINT RESULT [--url DAEMON_URL]``; with a URL it
loads through ``--load-format weight_cache``, else with vLLM's default loader). It writes one
JSON object (:class:`EngineResult`) to ``RESULT``: the tokens, the model load's seconds, and
what the loader said: that it attached, that it donated its load, or why it fell back.

Start it with ``tests/vllm/startup`` on ``PYTHONPATH`` (a plain AVX2 host, as the vLLM tests see
it). The KV cache is bfloat16: vLLM's CPU attention takes an FP8 one only with AVX-512."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from pydantic import BaseModel

from engine_client.fallback import FALLING_BACK

PROMPT = [1, 2, 3, 4, 5]
MAX_TOKENS = 8
ATTACHED = "weight-cache: attached "  # how the loader's line saying it attached begins
DONATED = "weight-cache: donated "  # how the loader's line saying it donated its load begins


class EngineResult(BaseModel):
    """What one engine run produced and what its loader reported."""

    tokens: list[int]
    loading_s: float
    attached: str | None = None  # the loader's "attached N tensors ..." line
    donated: str | None = None  # the loader's "donated MODEL (N tensors)" line
    fallback: str | None = None  # the loader's "falling back ... (reason): ..." line


class LoaderReport(logging.Handler):
    """Keeps the ``weight_cache`` loader's line saying it attached, or why it fell back."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.attached: str | None = None
        self.donated: str | None = None
        self.fallback: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(ATTACHED):
            self.attached = message
        elif message.startswith(DONATED):
            self.donated = message
        elif FALLING_BACK in message:
            self.fallback = message


def run(checkpoint: Path, url: str | None) -> EngineResult:
    """Start the engine on ``checkpoint`` (attached to the daemon at ``url``, if given) and
    generate :data:`MAX_TOKENS` tokens greedily after :data:`PROMPT`."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from harness.vllm_cpu import cutlass_kernel_on_cpu, provide_cpu_ops, time_model_loads

    provide_cpu_ops()
    loads: list[float] = []
    time_model_loads(loads)
    report = LoaderReport()
    loader_log = logging.getLogger("engine_client")
    loader_log.addHandler(report)
    loader_log.setLevel(logging.INFO)
    from vllm import LLM, SamplingParams

    loader = (
        {"load_format": "weight_cache", "model_loader_extra_config": {"url": url}} if url else {}
    )
    with cutlass_kernel_on_cpu():
        llm = LLM(
            model=str(checkpoint),
            skip_tokenizer_init=True,
            dtype="bfloat16",
            kv_cache_dtype="bfloat16",
            max_model_len=256,
            max_num_seqs=1,
            max_num_batched_tokens=256,
            enforce_eager=True,
            seed=0,
            use_tqdm_on_load=False,  # no progress bar after an error
            kv_cache_memory_bytes=64 * 2**20,  # not a share of the host's memory
            **loader,
        )
        (out,) = llm.generate(
            [{"prompt_token_ids": PROMPT}],
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0, detokenize=False),
            use_tqdm=False,
        )
    return EngineResult(
        tokens=list(out.outputs[0].token_ids),
        loading_s=loads[-1],
        attached=report.attached,
        donated=report.donated,
        fallback=report.fallback,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.cpu_engine", description=__doc__)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("result", type=Path, help="where the JSON result is written")
    parser.add_argument("--url", help="the daemon to attach to (else vLLM's default loader)")
    args = parser.parse_args(argv)
    args.result.write_text(run(args.checkpoint, args.url).model_dump_json())


if __name__ == "__main__":
    main()
