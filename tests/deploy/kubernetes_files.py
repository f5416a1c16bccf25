"""The Kubernetes manifests as the checks see them: every topology under ``deploy/kubernetes``
rendered, its pods and containers, and the facts they are checked against."""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.kustomize import KUSTOMIZATION, Resource, render

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
GUIDE = KUBERNETES / "README.md"
WAIVERS = KUBERNETES / "checkov-waivers.yaml"
# Every directory holding a kustomization is a topology an operator applies with `kubectl -k`.
TOPOLOGIES = sorted(p.name for p in KUBERNETES.iterdir() if (p / KUSTOMIZATION).is_file())

# The oldest Kubernetes the manifests are for, and the one their schemas are checked against:
# 1.34 serves DRA's resource.k8s.io/v1 by default (GA; v1beta1 and v1beta2 need opting in) and
# has DRA admin access on by default (beta), and native sidecar containers (GA in 1.33).
MIN_KUBERNETES = "1.34.0"
DRA_API_VERSION = "resource.k8s.io/v1"

# Containers by what they run: the daemon image (docker/Dockerfile) or the engine image
# (docker/Dockerfile.vllm). A container of another name fails the checks until it is sorted here.
# The prerequisites check (docker/check_prerequisites.py) is in the daemon's image.
PREREQUISITES = "prerequisites"
DAEMON_IMAGE_CONTAINERS = {"daemon", "keeper", PREREQUISITES}
ENGINE_IMAGE_CONTAINERS = {"engine", "engine-b", "wait-for-daemon"}
# Caddy in front of a warm standby's two engines (sidecar-warm-standby), from its own image.
PROXY_CONTAINERS = {"proxy"}
PROXY_IMAGE = "caddy:2.11"
RUN_DIR = "/run/weight-cache"
# The node cache's engines keep their compile and kernel caches in this directory of their node.
NODE_ENGINE_CACHE = "/var/cache/weight-cache"

# Settings decided for this round (file-descriptor handles, the keeper) whose fields another
# branch adds to DaemonSettings; the manifests already set them. Once service/env.py knows a name
# it is checked like any other; until then its value must be one of those decided.
PENDING_VARIABLES = {
    "WEIGHT_CACHE_RUN_DIR": {RUN_DIR},
    "WEIGHT_CACHE_CUDA_HANDLES": {"fd", "ipc"},
    "WEIGHT_CACHE_KEEPER": {"auto", "external", "off"},
}

WORKLOAD_KINDS = {"Deployment", "DaemonSet", "StatefulSet", "Job"}


@functools.cache
def _rendered(topology: str) -> tuple[Resource, ...]:
    return tuple(render(KUBERNETES / topology))


def rendered(topology: str) -> list[Resource]:
    return list(_rendered(topology))


def all_resources() -> Iterator[tuple[str, Resource]]:
    for topology in TOPOLOGIES:
        for resource in rendered(topology):
            yield topology, resource


@dataclass(frozen=True)
class Pod:
    """The pod template of a workload, as the kubelet will run it."""

    topology: str
    workload: Resource

    @property
    def name(self) -> str:
        return f"{self.topology}/{self.workload['kind']}/{self.workload['metadata']['name']}"

    @property
    def template(self) -> dict[str, Any]:
        template: dict[str, Any] = self.workload["spec"]["template"]
        return template

    @property
    def spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = self.template["spec"]
        return spec

    def containers(self) -> list[dict[str, Any]]:
        """Init containers (native sidecars among them) and containers, in start order."""
        return [*self.spec.get("initContainers", []), *self.spec["containers"]]

    def container(self, name: str) -> dict[str, Any] | None:
        return next((c for c in self.containers() if c["name"] == name), None)

    def volume(self, name: str) -> dict[str, Any]:
        return next(v for v in self.spec.get("volumes", []) if v["name"] == name)


def pods() -> list[Pod]:
    return [
        Pod(topology, resource)
        for topology, resource in all_resources()
        if resource["kind"] in WORKLOAD_KINDS
    ]


def env_of(container: dict[str, Any]) -> dict[str, str]:
    """The container's variables given as values (those from the downward API left out)."""
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def arg_after(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def tool(name: str) -> Path:
    """A tool of the manifests' checks, from the environment `make deploy-tools` creates. Outside
    CI a missing tool skips the check (saying how to get it); in CI it fails."""
    venv = Path(os.environ.get("DEPLOY_VENV", ".venv-deploy"))
    path = (venv if venv.is_absolute() else ROOT / venv) / "bin" / name
    if not path.is_file():
        message = f"{name} is not installed in {venv}: run `make deploy-tools`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def write_rendered(directory: Path) -> dict[str, Path]:
    """Each topology rendered into ``directory/<topology>/manifests.yaml``, as one file of
    documents (what `kubectl kustomize` prints)."""
    import yaml

    shutil.rmtree(directory, ignore_errors=True)
    files = {}
    for topology in TOPOLOGIES:
        path = directory / topology / "manifests.yaml"
        path.parent.mkdir(parents=True)
        path.write_text(yaml.safe_dump_all(rendered(topology), sort_keys=False))
        files[topology] = path
    return files
