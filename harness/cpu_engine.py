"""One vLLM 0.33 engine on vLLM's CPU platform, greedy on a fixed prompt, in this process (run as
a script: ``python -m harness.cpu_engine CHECKPOINT [DAEMON_URL]``; with a URL it loads through
``--load-format weight_cache``, else with vLLM's default loader). It prints one JSON line: the
tokens, the model load's seconds, and the fallback's reason if attaching fell back.

Start it with ``tests/vllm/startup`` on ``PYTHONPATH`` (a plain AVX2 host, as the vLLM tests see
it). The KV cache is bfloat16: vLLM's CPU attention takes an FP8 one only with AVX-512."""

from __future__ import annotations

import json
import logging
import os
import sys

PROMPT = [1, 2, 3, 4, 5]
MAX_TOKENS = 8
FALLING_BACK = "falling back to vLLM's default loader"


class FallbackReason(logging.Handler):
    """Keeps the loader's fallback warning (``engine_client.fallback.record_fallback``)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.message: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if FALLING_BACK in record.getMessage():
            self.message = record.getMessage()


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from harness.vllm_cpu import cutlass_kernel_on_cpu, provide_cpu_ops, time_model_loads

    checkpoint, url = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    provide_cpu_ops()
    loads: list[float] = []
    time_model_loads(loads)
    fallback = FallbackReason()
    logging.getLogger("engine_client").addHandler(fallback)
    from vllm import LLM, SamplingParams

    loader = (
        {"load_format": "weight_cache", "model_loader_extra_config": {"url": url}} if url else {}
    )
    with cutlass_kernel_on_cpu():
        llm = LLM(
            model=checkpoint,
            skip_tokenizer_init=True,
            dtype="bfloat16",
            kv_cache_dtype="bfloat16",
            max_model_len=256,
            max_num_seqs=1,
            max_num_batched_tokens=256,
            enforce_eager=True,
            seed=0,
            kv_cache_memory_bytes=64 * 2**20,  # not a share of the host's memory
            **loader,
        )
        (out,) = llm.generate(
            [{"prompt_token_ids": PROMPT}],
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0, detokenize=False),
            use_tqdm=False,
        )
    result = {"tokens": list(out.outputs[0].token_ids), "loading_s": loads[-1]}
    print(json.dumps({**result, "fallback": fallback.message}), flush=True)


if __name__ == "__main__":
    main()
