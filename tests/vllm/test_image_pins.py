"""The vLLM these tests run is the one constraints.txt pins, the base of both images
(vllm/vllm-openai:v<pin>), and its torch is the one that vLLM requires exactly: so the images
carry the torch and CUDA the vLLM tests ran with (tests/deploy/test_images.py holds the
Dockerfiles to the pin)."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_vllm_and_its_torch_are_the_pinned_ones() -> None:
    pins = re.findall(r"^vllm==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M)
    assert pins == [importlib.metadata.version("vllm")]
    requires = importlib.metadata.requires("vllm") or []
    (torch_pin,) = [r for r in requires if re.fullmatch(r"torch==\S+", r)]
    assert torch.__version__.split("+")[0] == torch_pin.removeprefix("torch==")
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert f"torch {torch.__version__.split('+')[0]}" in dockerfile
    assert torch.version.cuda is None or f"CUDA {torch.version.cuda}" in dockerfile
