"""The images agree everywhere they are named: one tag scheme (the package's version) for compose,
the Kubernetes manifests and the build script; every compose service that runs one can build
it; both start from vLLM's image at the version constraints.txt pins; the build script skips
cleanly, saying so, where no Docker daemon answers."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from types import ModuleType
from typing import Any

import pytest
import yaml

from protocol.version import __version__
from tests.deploy.kubernetes_files import (
    DAEMON_IMAGE_CONTAINERS,
    ENGINE_IMAGE_CONTAINERS,
    PROXY_CONTAINERS,
    PROXY_IMAGE,
    pods,
)
from tests.deploy.test_compose import (
    COMPOSE,
    DOCKER,
    env_example,
    load_standby,
    merged,
    substitute,
)

ROOT = DOCKER.parent
DAEMON_TAG = f"weight-cache:{__version__}"
ENGINE_TAG = f"vllm-weight-cache:{__version__}"


def images_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docker_images", DOCKER / "images.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def vllm_pin() -> str:
    pins: list[str] = re.findall(r"^vllm==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M)
    (pin,) = pins
    return pin


def compose_with_defaults() -> dict[str, Any]:
    """The compose files (compose.yaml, and compose.standby.yaml over it) as Compose reads them
    with no docker/.env: every default applies."""
    loaded: dict[str, Any] = yaml.safe_load(substitute(COMPOSE.read_text(), {}))
    whole: dict[str, Any] = merged(loaded, load_standby({}))
    return whole


def test_one_tag_scheme_for_compose_kubernetes_and_the_build() -> None:
    services = compose_with_defaults()["services"]
    assert services["daemon"]["image"] == services["keeper"]["image"] == DAEMON_TAG
    assert services["engine"]["image"] == services["standby"]["image"] == ENGINE_TAG
    example = env_example()
    assert (example["WEIGHT_CACHE_IMAGE"], example["ENGINE_IMAGE"]) == (DAEMON_TAG, ENGINE_TAG)
    for pod in pods():
        for container in pod.containers():
            name = container["name"]
            if name in PROXY_CONTAINERS:
                assert container["image"] == PROXY_IMAGE == env_example()["CADDY_IMAGE"]
                continue
            expected = DAEMON_TAG if name in DAEMON_IMAGE_CONTAINERS else ENGINE_TAG
            assert name in DAEMON_IMAGE_CONTAINERS | ENGINE_IMAGE_CONTAINERS, name
            assert container["image"] == expected, (pod.name, name)
    assert images_script().images() == {
        DAEMON_TAG: "docker/Dockerfile",
        ENGINE_TAG: "docker/Dockerfile.vllm",
    }


def test_every_service_that_runs_an_image_of_ours_builds_it() -> None:
    """Each service that runs one of the two images has the build that makes it (the same build
    for one tag, so Compose builds it once), in compose.yaml or its override."""
    services = compose_with_defaults()["services"]
    builds: dict[str, Any] = {}
    for name, service in services.items():
        if service["image"] in (DAEMON_TAG, ENGINE_TAG):
            assert "build" in service, name
            builds.setdefault(service["image"], service["build"])
            assert service["build"] == builds[service["image"]], name
    assert builds[DAEMON_TAG]["dockerfile"] == "docker/Dockerfile"
    assert builds[ENGINE_TAG]["dockerfile"] == "docker/Dockerfile.vllm"


def test_both_images_start_from_the_pinned_vllm() -> None:
    """torch, CUDA and vLLM as the project tests them: vLLM's image at the version
    constraints.txt pins (the vLLM tests' environment is made with it too; tests/vllm checks
    the torch that vLLM brings)."""
    base = f"vllm/vllm-openai:v{vllm_pin()}"
    for dockerfile in ("Dockerfile", "Dockerfile.vllm"):
        text = (DOCKER / dockerfile).read_text()
        assert re.findall(r"^ARG VLLM_IMAGE=(\S+)$", text, re.M) == [base], dockerfile
        assert re.findall(r"^FROM (\S+)", text, re.M) == ["${VLLM_IMAGE}"], dockerfile
    services = compose_with_defaults()["services"]
    for name in ("daemon", "keeper", "engine", "standby"):
        assert services[name]["build"]["args"] == {"VLLM_IMAGE": base}, name
    assert env_example()["VLLM_IMAGE"] == base
    assert images_script().base_image() == base
    makefile = (ROOT / "Makefile").read_text()
    assert "VLLM_PIN := $(shell sed -n 's/^vllm==//p' constraints.txt)" in makefile
    assert '"vllm==$(VLLM_PIN)"' in makefile


def test_the_engine_image_adds_cuda_bindings_at_the_cuda_extras_range() -> None:
    """The engine image adds cuda-bindings alone (vLLM brings its own NVML reader) at the range
    the `cuda` extra declares, so the two cannot drift apart."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    (extra,) = re.findall(r"^cuda = \[(.*)\]$", pyproject, re.M)
    (bindings,) = re.findall(r'"(cuda-bindings[^"]*)"', extra)
    dockerfile = (DOCKER / "Dockerfile.vllm").read_text()
    assert re.findall(r'"(cuda-bindings[^"]*)"', dockerfile) == [bindings]


def test_the_build_script_skips_cleanly_without_a_docker_daemon() -> None:
    """Here (and in CI) no Docker daemon answers: the script says so and exits 0."""
    script = images_script()
    why = script.docker_daemon(shutil.which("docker"))
    if why is None:
        pytest.skip("a Docker daemon answers here: `make images` builds for real")
    out = subprocess.run(
        [sys.executable, str(DOCKER / "images.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"skipped: {why}; built none of {DAEMON_TAG}, {ENGINE_TAG}\n"
    assert "images:" in (ROOT / "Makefile").read_text()
