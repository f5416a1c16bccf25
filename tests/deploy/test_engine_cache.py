"""Engines keep their compile and kernel caches where a restarted engine container finds them, in
compose and in every Kubernetes topology, and share them between the engines of one host or node
where the platform allows. One definition of the variables: compose.yaml's ``x-engine-cache``;
every other engine (compose's standby, every Kubernetes engine container) sets the same."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

import pytest
import yaml

from tests.deploy.kubernetes_files import (
    NODE_ENGINE_CACHE,
    PREREQUISITES,
    Pod,
    arg_after,
    env_of,
    pods,
    rendered,
)
from tests.deploy.test_compose import COMPOSE, env_example, load_standby, merged, substitute
from tests.deploy.test_kubernetes_manifests import is_warm_standby

ENGINE_DOCKERFILE = "docker/Dockerfile.vllm"
# The caches a cold engine fills: vLLM's torch.compile artifacts, and the kernels it compiles
# through Triton and inductor (vLLM puts those under its own cache only while it compiles, and
# Triton's not at all when TRITON_CACHE_DIR is set), FlashInfer's JIT builds, anything XDG-aware.
CACHE_VARIABLES = {
    "VLLM_CACHE_ROOT",
    "TRITON_CACHE_DIR",
    "TORCHINDUCTOR_CACHE_DIR",
    "XDG_CACHE_HOME",
    "FLASHINFER_WORKSPACE_BASE",
}
ENGINE_CONTAINERS = {"engine", "engine-b"}
# Topologies whose namespace enforces the Restricted pod security standard, which refuses every
# hostPath: their engines' cache is the pod's (an emptyDir), kept across container restarts.
RESTRICTED_CACHE = "emptyDir"


def compose_files() -> dict[str, Any]:
    """compose.yaml, and compose.standby.yaml merged over it, with .env.example's values."""
    base: dict[str, Any] = yaml.safe_load(substitute(COMPOSE.read_text(), env_example()))
    whole: dict[str, Any] = merged(base, load_standby())
    return whole


def compose_engines() -> dict[str, dict[str, Any]]:
    """The services that run vLLM (built from the engine's Dockerfile), standby included."""
    return {
        name: service
        for name, service in compose_files()["services"].items()
        if service.get("build", {}).get("dockerfile") == ENGINE_DOCKERFILE
    }


def engine_cache() -> dict[str, str]:
    cache: dict[str, str] = compose_files()["x-engine-cache"]
    return cache


def under(path: str, root: str) -> bool:
    return PurePosixPath(path).is_relative_to(PurePosixPath(root))


def test_the_cache_variables_cover_every_kernel_cache() -> None:
    assert set(engine_cache()) == CACHE_VARIABLES
    roots = {PurePosixPath(p) for p in engine_cache().values()}
    volume = min(roots, key=lambda p: len(p.parts))
    assert all(p.is_relative_to(volume) for p in roots)  # one volume holds them all


def test_compose_has_both_engines_and_its_standby_profile_is_the_warm_standby() -> None:
    engines = compose_engines()
    assert set(engines) == {"engine", "standby"}
    for name, service in engines.items():
        assert service["entrypoint"][:2] == ["weight-cache", "standby"], name
        assert "--enable-sleep-mode" in service["command"], name


@pytest.mark.parametrize("name", ["engine", "standby"])
def test_compose_engines_set_the_cache_variables(name: str) -> None:
    service = compose_engines()[name]
    assert {k: v for k, v in service["environment"].items() if k in CACHE_VARIABLES} == (
        engine_cache()
    )


@pytest.mark.parametrize("name", ["engine", "standby"])
def test_compose_engines_keep_the_cache_on_the_shared_named_volume(name: str) -> None:
    """Every cache path lies on a named volume (declared at the top level, so it outlives the
    container), the same one for every engine of the file: the engines of one host share it."""
    whole = compose_files()
    service = compose_engines()[name]
    mounts = {}
    for entry in service["volumes"]:
        source, target = entry.split(":")[:2]
        mounts[target] = source
    kept = set()
    for variable, path in engine_cache().items():
        holders = [t for t in mounts if under(path, t)]
        assert holders, (name, variable, path)
        source = mounts[max(holders, key=len)]
        assert source in whole["volumes"], (name, variable, source)
        kept.add(source)
    assert kept == {"engine-cache"}, kept


def engine_pods() -> list[Pod]:
    return [p for p in pods() if any(c["name"] in ENGINE_CONTAINERS for c in p.containers())]


def engine_containers() -> list[tuple[Pod, dict[str, Any]]]:
    return [(p, c) for p in engine_pods() for c in p.containers() if c["name"] in ENGINE_CONTAINERS]


def ids(item: tuple[Pod, dict[str, Any]]) -> str:
    return f"{item[0].name}/{item[1]['name']}"


ENGINES = engine_containers()


@pytest.mark.parametrize("item", ENGINES, ids=[ids(e) for e in ENGINES])
def test_kubernetes_engines_set_the_compose_cache_variables(
    item: tuple[Pod, dict[str, Any]],
) -> None:
    _, engine = item
    assert {k: v for k, v in env_of(engine).items() if k in CACHE_VARIABLES} == engine_cache()


def cache_volume(pod: Pod, container: dict[str, Any], path: str) -> dict[str, Any]:
    """The volume the container mounts at or above ``path``, writable; fails when the path is on
    the container's own (read-only) file system."""
    mounts = [m for m in container["volumeMounts"] if under(path, m["mountPath"])]
    assert mounts, f"{path} is on the container's file system"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    assert not mount.get("readOnly"), mount
    return pod.volume(mount["name"])


@pytest.mark.parametrize("item", ENGINES, ids=[ids(e) for e in ENGINES])
def test_kubernetes_engines_keep_every_cache_on_a_volume_of_the_pod(
    item: tuple[Pod, dict[str, Any]],
) -> None:
    """On one volume that outlives the engine container (an emptyDir lives as long as the pod,
    a hostPath as long as the node's directory), the same for every cache variable."""
    pod, engine = item
    volumes = [cache_volume(pod, engine, path) for path in engine_cache().values()]
    assert all(v == volumes[0] for v in volumes)
    assert {"emptyDir", "hostPath"} & set(volumes[0])


@pytest.mark.parametrize("pod", engine_pods(), ids=lambda p: p.name)
def test_engines_of_one_pod_share_one_cache(pod: Pod) -> None:
    """The warm standby's two engines (sidecar-warm-standby) compile once between them."""
    engines = [c for c in pod.containers() if c["name"] in ENGINE_CONTAINERS]
    path = engine_cache()["VLLM_CACHE_ROOT"]
    names = {
        max(
            (m for m in c["volumeMounts"] if under(path, m["mountPath"])),
            key=lambda m: len(m["mountPath"]),
        )["name"]
        for c in engines
    }
    assert len(names) == 1
    if any(is_warm_standby(c) for c in engines):
        assert len(engines) == 2 and all(is_warm_standby(c) for c in engines)


def test_node_cache_engines_share_the_node_directory() -> None:
    """Engine pods of a node share one directory of the node, so a new engine pod (a rollout, a
    rescheduled pod) finds the caches its predecessors filled; the pod checks it is writable
    before it starts (its prerequisites)."""
    (pod,) = [p for p in engine_pods() if p.topology == "node-cache"]
    (engine,) = [c for c in pod.containers() if c["name"] == "engine"]
    volume = cache_volume(pod, engine, engine_cache()["VLLM_CACHE_ROOT"])
    assert volume["hostPath"] == {"path": NODE_ENGINE_CACHE, "type": "Directory"}
    check = pod.container(PREREQUISITES)
    assert check is not None
    mount = next(m for m in engine["volumeMounts"] if m["name"] == volume["name"])
    assert arg_after(check["args"], "--writable") == mount["mountPath"]


def restricted(pod: Pod) -> bool:
    (namespace,) = [r for r in rendered(pod.topology) if r["kind"] == "Namespace"]
    enforced: str = namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
    return enforced == "restricted"


@pytest.mark.parametrize("pod", [p for p in engine_pods() if restricted(p)], ids=lambda p: p.name)
def test_restricted_topologies_keep_the_cache_in_the_pod(pod: Pod) -> None:
    """A Restricted namespace admits no hostPath: the cache is the pod's emptyDir."""
    (engine,) = [c for c in pod.containers() if c["name"] == "engine"]
    volume = cache_volume(pod, engine, engine_cache()["VLLM_CACHE_ROOT"])
    assert RESTRICTED_CACHE in volume
