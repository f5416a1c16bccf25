"""``make demo`` as a user runs it (its Python entry, in vLLM's environment, as the Makefile
starts it): a real vLLM 0.33 engine on this machine's CPU attached to the demo model and one
with vLLM's default loader print the same tokens and both model loads; when attaching falls
back, the loader's reason is the last line; when vLLM's own load then fails, its error is its
own and ends with the fallback's reason."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.daemon_process import free_port
from harness.engine_demo import EngineFailed, run_engine
from service.demo import write_demo_checkpoint
from tests.vllm.cpu_capabilities import STARTUP

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
LOADING = re.compile(r"^(weight_cache|default):\s+Model loading took (\d+\.\d+) seconds$")


def demo(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m harness.engine_demo ARGS`` with the environment ``make demo`` gives it."""
    env = {
        **os.environ,
        "PYTHONPATH": f"{STARTUP}:{ROOT}",
        "VLLM_TARGET_DEVICE": "cpu",
    }
    return subprocess.run(
        [sys.executable, "-m", "harness.engine_demo", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )


def tokens(out: list[str], loader: str) -> list[int]:
    (line,) = [line for line in out if line.startswith(f"{loader} tokens:")]
    return [int(t) for t in re.findall(r"\d+", line.split(":", 1)[1])]


def loads(out: list[str]) -> dict[str, float]:
    return {m[1]: float(m[2]) for line in out if (m := LOADING.match(line))}


def masked(lines: list[str]) -> list[str]:
    """Lines with their run's directory and every number masked."""
    return [
        re.sub(r"\d+(\.\d+)?", "N", re.sub(r"weight-cache-demo-\w+", "W", line)) for line in lines
    ]


def readme_demo() -> list[str]:
    """What the README shows ``make demo`` print."""
    shown = README.split("$ make demo\n", 1)[1].split("```", 1)[0]
    return shown.rstrip().splitlines()


def test_the_demo_attaches_and_prints_both_loaders() -> None:
    """As a user runs it, and as the README shows it (numbers and paths aside)."""
    done = demo()
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout.splitlines()
    assert tokens(out, "weight_cache") == tokens(out, "default")
    assert len(tokens(out, "default")) == 8 and "tokens equal: True" in out
    assert set(loads(out)) == {"weight_cache", "default"}
    assert all(seconds > 0 for seconds in loads(out).values())
    assert re.fullmatch(r"weight_cache engine: attached \d+ tensors .*", out[-1]), out[-1]
    assert "falling back" not in done.stdout
    assert masked(out) == masked(readme_demo())


def test_a_fallback_is_the_last_line() -> None:
    """A daemon that is down: the engine falls back, still serves, and the reason ends the
    output."""
    done = demo("--url", f"http://127.0.0.1:{free_port()}")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout.splitlines()
    assert tokens(out, "weight_cache") == tokens(out, "default")
    assert set(loads(out)) == {"weight_cache", "default"}
    assert out[-1].startswith(
        "weight_cache engine: falling back to vLLM's default loader (daemon_unavailable): "
        "cannot reach the daemon at http://127.0.0.1:"
    ), out[-1]


def test_a_failure_of_vllms_own_load_after_a_fallback_is_its_own(tmp_path: Path) -> None:
    """A checkpoint vLLM's default loader refuses (a tensor no module has) and a daemon that is
    down: the engine's error is vLLM's, not chained onto why it could not attach, and what the
    demo prints of it ends with the fallback's reason."""
    checkpoint = tmp_path / "demo"
    write_demo_checkpoint(checkpoint, "fp8", "tiny")
    weights = checkpoint / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.0.mlp.unknown.weight"] = torch.zeros(2, 2, dtype=torch.bfloat16)
    save_file(tensors, weights, metadata={"format": "pt"})
    log = tmp_path / "engine.log"
    with pytest.raises(EngineFailed) as failed:
        run_engine(checkpoint, f"http://127.0.0.1:{free_port()}", log)
    shown = str(failed.value).splitlines()
    assert shown[0].startswith("the engine failed (exit 1); its output: ")
    assert shown[1:] == [
        shown[1],
        "weight-cache had fallen back to vLLM's default loader (daemon_unavailable); this error "
        "is that loader's own",
    ]
    assert shown[1].startswith("ValueError: There is no module or parameter named")
    printed = log.read_text()
    assert "DaemonUnavailableError" not in printed
    assert "During handling of the above exception" not in printed
    assert "direct cause of the following exception" not in printed
