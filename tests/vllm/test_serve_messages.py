"""The restart proof reads ``vllm serve``'s own lines (``tests.gpu.vllm_logs``) and speaks its
OpenAI API (``tests.gpu.completions``, ``tests.gpu.serve_engine``). These fail on the vLLM
version where a message, the log format, a flag or a field the proof relies on is gone."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from tests.gpu import vllm_logs

# (vLLM module, its message template, sample arguments, the proof's pattern for it)
MESSAGES = [
    (
        "vllm.v1.worker.gpu_model_runner",
        "Model loading took %s GiB memory and %.6f seconds",
        ("8.46", 3.71),
        vllm_logs.LOADING,
    ),
    (
        "vllm.v1.worker.gpu_model_runner",
        "Starting to load model %s...",
        ("/m",),
        vllm_logs.LOAD_START,
    ),
    (
        "vllm.v1.worker.gpu_model_runner",
        "Graph capturing finished in %.0f secs, took %.2f GiB",
        (2.0, 0.53),
        vllm_logs.GRAPHS,
    ),
    (
        "vllm.v1.worker.gpu_worker",
        "Available KV cache memory: %s GiB",
        ("30.1",),
        vllm_logs.KV_CACHE,
    ),
    (
        "vllm.v1.engine.core",
        "init engine (profile, create kv cache, warmup model) took %.2f s",
        (6.67,),
        vllm_logs.INIT_ENGINE,
    ),
    (
        "vllm.model_executor.model_loader.base_loader",
        "Initializing model took %.6f seconds",
        (0.62,),
        vllm_logs.INITIALIZING,
    ),
    (
        "vllm.entrypoints.launchers.api_server.entry",
        "Starting vLLM server on %s",
        ("http://127.0.0.1:8000",),
        vllm_logs.SERVER_START,
    ),
]


def _source(module: str) -> str:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, module
    return Path(spec.origin).read_text()


def _joined(source: str) -> str:
    """The source with adjacent string literals joined (vLLM splits long messages)."""
    return re.sub(r'"\s*\n\s*"', "", source)


@pytest.mark.parametrize(("module", "template", "args", "pattern"), MESSAGES)
def test_vllm_prints_the_messages_the_proof_reads(
    module: str, template: str, args: tuple[object, ...], pattern: re.Pattern[str]
) -> None:
    assert template in _joined(_source(module))
    assert pattern.search(template % args)


def test_compilation_time_follows_init_engine() -> None:
    source = _joined(_source("vllm.v1.engine.core"))
    assert "took %.2f s (compilation: %.2f s)" in source
    m = vllm_logs.INIT_ENGINE.search(
        "init engine (profile, create kv cache, warmup model) took 6.67 s (compilation: 2.31 s)"
    )
    assert m is not None and m.groups() == ("6.67", "2.31")


def test_log_lines_name_their_process_and_pid() -> None:
    from vllm import logger

    assert "(%(vllm_process_name)s pid=%(process)d)" in logger._FORMAT
    assert "decorate_logs()" in _source("vllm.v1.engine.core")  # EngineCore names itself


def test_serve_takes_the_flags_the_proof_passes() -> None:
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    options = {s for action in parser._actions for s in action.option_strings}
    for flag in (
        "--host",
        "--port",
        "--served-model-name",
        "--skip-tokenizer-init",
        "--seed",
        "--disable-uvicorn-access-log",
        "--max-model-len",
        "--max-num-seqs",
        "--gpu-memory-utilization",
        "--load-format",
        "--model-loader-extra-config",
    ):
        assert flag in options, flag


def test_completions_return_token_ids() -> None:
    from vllm.entrypoints.openai.completion.protocol import (
        CompletionRequest,
        CompletionResponseChoice,
    )

    assert "return_token_ids" in CompletionRequest.model_fields
    assert "token_ids" in CompletionResponseChoice.model_fields


def test_the_command_and_the_compile_cache_the_proof_relies_on() -> None:
    from vllm import envs
    from vllm.entrypoints.cli.main import main

    from tests.gpu.serve_engine import VLLM_MAIN

    assert callable(main) and "vllm.entrypoints.cli.main import main" in VLLM_MAIN
    # serve_proof.compile_cache_has_entries looks where vLLM keeps torch.compile's artifacts.
    assert "VLLM_CACHE_ROOT" in envs.environment_variables
    assert '"torch_compile_cache"' in _source("vllm.compilation.backends")
    assert "VLLM_USE_FLASHINFER_SAMPLER" in envs.environment_variables
