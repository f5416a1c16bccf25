"""What each Kubernetes pod needs from the cluster is created by its topology or checked by the
pod itself before anything starts (docker/check_prerequisites.py, the pods' first init
container): the token's Secret, the checkpoint's claim, the node's directories, the namespaces.
The check runs here as the pods run it, with the standard library alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.kubernetes_files import (
    DAEMON_IMAGE_CONTAINERS,
    GUIDE,
    PREREQUISITES,
    ROOT,
    TOPOLOGIES,
    Pod,
    arg_after,
    pods,
    rendered,
)

SCRIPT = ROOT / "docker" / "check_prerequisites.py"
IN_IMAGE = "/opt/weight-cache/check_prerequisites.py"  # docker/Dockerfile's WORKDIR and COPY
SECRET, KEY = "weight-cache-token", "token"
PODS = pods()


def check(*args: str, namespace: str = "serving", node: str = "gpu-7") -> tuple[int, str]:
    """The script as a pod runs it, isolated from site-packages (-I -S: the standard library
    alone), with its namespace and node from the downward API's variables."""
    env = {"PATH": os.environ["PATH"], "POD_NAMESPACE": namespace, "NODE_NAME": node}
    out = subprocess.run(
        [sys.executable, "-I", "-S", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    return out.returncode, out.stdout + out.stderr


@pytest.fixture
def token(tmp_path: Path) -> Path:
    path = tmp_path / "secret" / KEY
    path.parent.mkdir()
    path.write_text("0123456789abcdef0123456789abcdef\n")
    return path


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "models" / "Llama-3.1-8B-Instruct-FP8"
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def test_everything_present_passes(token: Path, checkpoint: Path, tmp_path: Path) -> None:
    code, out = check(
        "--token-file", str(token), "--checkpoint", str(checkpoint), "--writable", str(tmp_path)
    )
    assert code == 0, out
    assert str(checkpoint) in out and str(tmp_path) in out


def test_a_missing_secret_is_named_with_the_command_that_creates_it(tmp_path: Path) -> None:
    code, out = check("--token-file", str(tmp_path / "secret" / KEY), namespace="serving")
    assert code == 1
    create = (
        f"kubectl -n serving create secret generic {SECRET} "
        f'--from-literal={KEY}="$(openssl rand -hex 32)"'
    )
    assert f"the Secret {SECRET} (key {KEY}) is missing in namespace serving" in out
    assert create in out


def test_the_guide_gives_the_same_command() -> None:
    code, out = check("--token-file", "/nonexistent/token", namespace="NAMESPACE")
    assert code == 1
    line = (
        f"kubectl -n NAMESPACE create secret generic {SECRET} "
        f'--from-literal={KEY}="$(openssl rand -hex 32)"'
    )
    assert line in out and line in GUIDE.read_text()


def test_the_token_must_be_as_long_as_the_daemon_asks(tmp_path: Path) -> None:
    """The daemon's own minimum for a bind beyond loopback: shorter fails here, not later."""
    from service.settings import MIN_EXPOSED_TOKEN_CHARS

    path = tmp_path / KEY
    path.write_text("x" * (MIN_EXPOSED_TOKEN_CHARS - 1) + "\n")
    code, out = check("--token-file", str(path))
    assert code == 1 and f"at least {MIN_EXPOSED_TOKEN_CHARS}" in out
    path.write_text(" " + "x" * MIN_EXPOSED_TOKEN_CHARS + "\n")
    assert check("--token-file", str(path))[0] == 0


def test_a_checkpoint_missing_from_its_volume_names_the_claim(
    token: Path, checkpoint: Path
) -> None:
    code, out = check(
        "--token-file",
        str(token),
        "--checkpoint",
        str(checkpoint.parent / "v2"),
        "--claim",
        "models-nfs",
    )
    assert code == 1
    assert f"{checkpoint.parent / 'v2'} is not there" in out and "models-nfs" in out
    (checkpoint / "config.json").unlink()
    code, out = check("--token-file", str(token), "--checkpoint", str(checkpoint))
    assert code == 1 and "holds no config.json" in out


def test_a_missing_node_directory_names_the_node_and_how_to_make_it(token: Path) -> None:
    code, out = check("--token-file", str(token), "--writable", "/nonexistent/cache", node="n4")
    assert code == 1
    assert "/nonexistent/cache on n4 is not a directory" in out and "10001" in out


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    code, out = check(
        "--token-file",
        str(tmp_path / KEY),
        "--checkpoint",
        str(tmp_path / "m"),
        "--writable",
        str(tmp_path / "d"),
    )
    assert code == 1 and len(out.strip().splitlines()) == 3


def test_the_daemon_image_carries_the_script_where_the_pods_run_it() -> None:
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert "WORKDIR /opt/weight-cache" in dockerfile
    assert "COPY docker/check_prerequisites.py ./check_prerequisites.py" in dockerfile
    assert "!docker/check_prerequisites.py" in (ROOT / ".dockerignore").read_text().splitlines()


def pod_ids(pod: Pod) -> str:
    return pod.name


def prerequisites(pod: Pod) -> dict[str, Any]:
    first: dict[str, Any] = pod.spec["initContainers"][0]
    assert first["name"] == PREREQUISITES, pod.name
    return first


def flag_values(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


@pytest.mark.parametrize("pod", PODS, ids=pod_ids)
def test_every_pod_checks_first_and_to_its_end(pod: Pod) -> None:
    """The first init container, run to its end before the sidecars start, from the daemon's
    image (DAEMON_IMAGE_CONTAINERS), running the script the image carries."""
    container = prerequisites(pod)
    assert "restartPolicy" not in container
    assert PREREQUISITES in DAEMON_IMAGE_CONTAINERS
    assert container["command"] == ["python3", IN_IMAGE]
    assert [c["name"] for c in pod.containers()].count(PREREQUISITES) == 1


def downward(container: dict[str, Any]) -> dict[str, str]:
    return {
        e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
        for e in container.get("env", [])
        if "valueFrom" in e
    }


@pytest.mark.parametrize("pod", PODS, ids=pod_ids)
def test_the_check_reads_the_token_the_pod_mounts(pod: Pod) -> None:
    """The token file it checks is the Secret volume's file in every container that mounts it;
    the Secret's volume is optional, so a missing Secret reaches the check (which names it)
    rather than holding the pod in ContainerCreating; the namespace in its message is the pod's."""
    container = prerequisites(pod)
    path = arg_after(container["args"], "--token-file")
    secrets = [v for v in pod.spec["volumes"] if "secret" in v]
    (volume,) = secrets
    assert volume["secret"]["secretName"] == SECRET and volume["secret"]["optional"] is True
    (item,) = volume["secret"]["items"]
    assert item["key"] == KEY
    for c in pod.containers():
        for mount in c.get("volumeMounts", []):
            if mount["name"] == volume["name"]:
                assert f"{mount['mountPath']}/{item['path']}" == path, c["name"]
    assert downward(container)["POD_NAMESPACE"] == "metadata.namespace"


@pytest.mark.parametrize("pod", PODS, ids=pod_ids)
def test_the_check_covers_every_checkpoint_an_engine_loads(pod: Pod) -> None:
    """The checkpoint of each engine (its first argument), on the claim the pod mounts it from."""
    container = prerequisites(pod)
    engines = [c for c in pod.containers() if c["name"] in {"engine", "engine-b"}]
    checked = flag_values(container["args"], "--checkpoint")
    assert set(checked) == {e["args"][0] for e in engines}
    claims = {
        v["persistentVolumeClaim"]["claimName"]
        for v in pod.spec["volumes"]
        if "persistentVolumeClaim" in v
    }
    if checked:
        (claim,) = claims
        default = "weight-cache-models"  # the script's --claim default
        assert (flag_values(container["args"], "--claim") or [default]) == [claim]
        mounts = [m["mountPath"] for m in container["volumeMounts"]]
        assert all(any(c.startswith(m + "/") for m in mounts) for c in checked)


@pytest.mark.parametrize("pod", PODS, ids=pod_ids)
def test_the_check_covers_every_node_directory_the_pod_writes(pod: Pod) -> None:
    """Each hostPath a container mounts writable must be writable by uid 10001, which the kubelet
    does not check (``Directory`` only asks that it exists): the check mounts it and tries."""
    container = prerequisites(pod)
    host = {v["name"] for v in pod.spec["volumes"] if "hostPath" in v}
    written = {
        m["mountPath"]
        for c in pod.containers()
        if c["name"] != PREREQUISITES
        for m in c.get("volumeMounts", [])
        if m["name"] in host and not m.get("readOnly")
    }
    assert set(flag_values(container["args"], "--writable")) == written
    own = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    assert written <= own
    if written:
        assert downward(container)["NODE_NAME"] == "spec.nodeName"


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_the_topology_creates_its_namespaces(topology: str) -> None:
    """Every namespace its objects live in is one of its own objects."""
    resources = rendered(topology)
    created = {r["metadata"]["name"] for r in resources if r["kind"] == "Namespace"}
    assert created
    assert {r["metadata"]["namespace"] for r in resources if r["kind"] != "Namespace"} <= created


def guide_prerequisites() -> str:
    text = GUIDE.read_text()
    start = text.index("## What the cluster provides")
    return text[start : text.index("\n## ", start + 1)]


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_namespaces_named_but_not_created_are_the_clusters_and_documented(topology: str) -> None:
    """A namespace named in a selector (Prometheus's, ``monitoring``) is not created here (it is
    the monitoring stack's: applying would take it over, deleting would delete Prometheus),
    and the guide's prerequisites name it."""
    resources = rendered(topology)
    created = {r["metadata"]["name"] for r in resources if r["kind"] == "Namespace"}
    named = {
        peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
        for r in resources
        if r["kind"] == "NetworkPolicy"
        for rule in r["spec"].get("ingress", [])
        for peer in rule.get("from", [])
        if "namespaceSelector" in peer
    }
    assert named == {"monitoring"}
    assert not named & created
    section = guide_prerequisites()
    assert all(f"`{n}`" in section for n in named)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_claims_and_secrets_are_the_operators_and_documented(topology: str) -> None:
    """The checkpoint's claim and the token's Secret hold what the manifests cannot produce (a
    checkpoint, a credential kept out of git): no object of theirs here (``kubectl delete -k``
    would delete the operator's checkpoints), every one named in the guide's prerequisites."""
    resources = rendered(topology)
    assert not [r for r in resources if r["kind"] in {"Secret", "PersistentVolumeClaim"}]
    section = guide_prerequisites()
    for pod in [p for p in PODS if p.topology == topology]:
        for volume in pod.spec["volumes"]:
            if "persistentVolumeClaim" in volume:
                assert f"`{volume['persistentVolumeClaim']['claimName']}`" in section
            if "secret" in volume:
                assert f"`{volume['secret']['secretName']}`" in section
