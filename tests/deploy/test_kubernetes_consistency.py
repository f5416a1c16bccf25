"""The Kubernetes manifests, docker/compose.yaml, the Dockerfiles and the READMEs name the same
images, ports, variables and probes, and the daemon's own settings and options accept what the
manifests give it. Compose is read by what its services are built from, so services added beside
the daemon and the engine (a proxy, a second engine, a keeper) change nothing here."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from protocol.version import DEFAULT_PORT, __version__
from tests.deploy.kubernetes_files import (
    DAEMON_IMAGE_CONTAINERS,
    ENGINE_IMAGE_CONTAINERS,
    GUIDE,
    PENDING_VARIABLES,
    ROOT,
    RUN_DIR,
    Pod,
    arg_after,
    env_of,
    pods,
)
from tests.deploy.test_compose import COMPOSE, DOCKER, env_example, substitute

PODS = pods()
README = ROOT / "README.md"
OPERATING = ROOT / "docs" / "operating.md"  # the operator's guide, Docker and Kubernetes
DAEMON_DOCKERFILE = "docker/Dockerfile"
ENGINE_DOCKERFILE = "docker/Dockerfile.vllm"
PREFIX = "WEIGHT_CACHE_"


def pod_ids(pod: Pod) -> str:
    return pod.name


def compose_services(dockerfile: str) -> list[dict[str, Any]]:
    """The compose services built from ``dockerfile``, with .env.example's values."""
    compose = yaml.safe_load(substitute(COMPOSE.read_text(), env_example()))
    services = [
        s
        for s in compose["services"].values()
        if isinstance(s.get("build"), dict) and s["build"].get("dockerfile") == dockerfile
    ]
    assert services, dockerfile
    return services


def repository(image: str) -> str:
    """``registry/name:tag`` or ``name@sha256:...`` without its tag or digest."""
    name = image.split("@", maxsplit=1)[0]
    return name.rsplit(":", 1)[0] if ":" in name.rsplit("/", 1)[-1] else name


def container_ports(service: dict[str, Any]) -> set[int]:
    ports = set()
    for entry in service.get("ports", []):
        target = entry["target"] if isinstance(entry, dict) else str(entry).split(":")[-1]
        ports.add(int(str(target).split("/")[0]))
    return ports


def seconds(duration: str) -> float:
    """A compose or Dockerfile duration (``1m30s``, ``15m``, ``3s``) in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(float(n) * scale[u] for n, u in parts)


def containers(names: set[str]) -> list[tuple[Pod, dict[str, Any]]]:
    return [(p, c) for p in PODS for c in p.containers() if c["name"] in names]


def test_images_are_the_ones_compose_builds() -> None:
    """Daemon and keeper run the image compose builds from docker/Dockerfile, engines the one it
    builds from docker/Dockerfile.vllm, at the project's release as the tag."""
    for dockerfile, names in (
        (DAEMON_DOCKERFILE, DAEMON_IMAGE_CONTAINERS),
        (ENGINE_DOCKERFILE, ENGINE_IMAGE_CONTAINERS),
    ):
        (built,) = {repository(s["image"]) for s in compose_services(dockerfile)}
        for pod, container in containers(names):
            assert container["image"] == f"{built}:{__version__}", (pod.name, container["name"])


def test_images_are_named_in_the_readmes() -> None:
    operating, guide = OPERATING.read_text(), GUIDE.read_text()
    for _, container in containers(DAEMON_IMAGE_CONTAINERS | ENGINE_IMAGE_CONTAINERS):
        image = container["image"]
        assert f"`{image}`" in operating, image
        assert image in guide, image


def test_daemon_port_is_the_one_compose_and_the_image_expose() -> None:
    exposed = re.findall(r"^EXPOSE (\d+)$", (DOCKER / "Dockerfile").read_text(), re.M)
    assert exposed == [str(DEFAULT_PORT)]
    for service in compose_services(DAEMON_DOCKERFILE):
        assert container_ports(service) <= {DEFAULT_PORT}
    assert any(container_ports(s) == {DEFAULT_PORT} for s in compose_services(DAEMON_DOCKERFILE))
    for pod, daemon in containers({"daemon"}):
        assert [(p["name"], p["containerPort"]) for p in daemon["ports"]] == [
            ("wc-http", DEFAULT_PORT)
        ], pod.name
    for text in (README.read_text(), OPERATING.read_text(), GUIDE.read_text()):
        assert str(DEFAULT_PORT) in text


def test_engine_port_is_one_compose_uses() -> None:
    compose_ports = set().union(*(container_ports(s) for s in compose_services(ENGINE_DOCKERFILE)))
    for pod, engine in containers({"engine"}):
        (port,) = engine["ports"]
        assert port["containerPort"] in compose_ports, pod.name
        assert int(arg_after(engine["args"], "--port")) == port["containerPort"]


def _dockerfile_healthcheck() -> tuple[dict[str, str], str]:
    text = (DOCKER / "Dockerfile").read_text().replace("\\\n", " ")
    (line,) = re.findall(r"^HEALTHCHECK (.*)$", text, re.M)
    options = dict(re.findall(r"--([a-z-]+)=(\S+)", line))
    (path,) = re.findall(r"127\.0\.0\.1:\d+(/\w+)", line)
    return options, path


def _compose_daemon_healthchecks() -> list[tuple[dict[str, Any], str]]:
    """Healthchecks of compose's daemon services that ask the daemon's HTTP port."""
    checks = []
    for service in compose_services(DAEMON_DOCKERFILE):
        check = service.get("healthcheck")
        if check:
            found = re.findall(rf"127\.0\.0\.1:{DEFAULT_PORT}(/\w+)", " ".join(check["test"]))
            if found:
                checks.append((check, found[0]))
    assert checks
    return checks


@pytest.mark.parametrize("pod", [p for p in PODS if p.container("daemon")], ids=pod_ids)
def test_daemon_probes_match_compose_and_the_image(pod: Pod) -> None:
    """Liveness is the image's HEALTHCHECK (/health), readiness and start-up compose's (/ready)
    with the same interval, timeout and retries; the start-up probe gives the first load the
    start period compose gives it (.env.example's DAEMON_START_PERIOD)."""
    daemon = pod.container("daemon")
    assert daemon is not None
    options, path = _dockerfile_healthcheck()
    liveness = daemon["livenessProbe"]
    assert liveness["httpGet"]["path"] == path
    assert liveness["periodSeconds"] == seconds(options["interval"])
    assert liveness["timeoutSeconds"] == seconds(options["timeout"])
    assert liveness["failureThreshold"] == int(options["retries"])
    for check, ready_path in _compose_daemon_healthchecks():
        readiness = daemon.get("readinessProbe")  # none in the sidecar pod: the engine's counts
        if readiness is not None:
            assert readiness["httpGet"]["path"] == ready_path
            assert readiness["periodSeconds"] == seconds(check["interval"])
            assert readiness["timeoutSeconds"] == seconds(check["timeout"])
            assert readiness["failureThreshold"] == check["retries"]
        startup = daemon["startupProbe"]
        assert startup["httpGet"]["path"] == ready_path
        assert startup["periodSeconds"] == seconds(check["interval"])
        assert startup["timeoutSeconds"] == seconds(check["timeout"])
        window = startup["periodSeconds"] * startup["failureThreshold"]
        assert window == seconds(check["start_period"])
        assert window == seconds(env_example()["DAEMON_START_PERIOD"])


def _variables(container: dict[str, Any]) -> dict[str, str]:
    return {k: v for k, v in env_of(container).items() if k.startswith(PREFIX)}


@pytest.mark.parametrize("pod", [p for p in PODS if p.container("daemon")], ids=pod_ids)
def test_daemon_variables_are_settings(pod: Pod, tmp_path: Path, monkeypatch) -> None:
    """Every WEIGHT_CACHE_* variable the manifests give the daemon or its keeper is one it
    knows, and the daemon's settings accept the daemon's values (its token file stands in)."""
    from service.env import check_environment, known_variables
    from service.settings import DaemonSettings

    known = set(known_variables())
    for name in ("daemon", "keeper"):
        container = pod.container(name)
        if container is None:
            continue
        variables = _variables(container)
        pending = {k: v for k, v in variables.items() if k in PENDING_VARIABLES and k not in known}
        for key, value in pending.items():
            assert value in PENDING_VARIABLES[key], (key, value)
        check_environment({k: v for k, v in variables.items() if k not in pending})
        if name == "daemon":
            token = tmp_path / "token"
            token.write_text("t" * 32)
            token.chmod(0o440)  # as the Secret volume mounts it (defaultMode 0440)
            for key in [k for k in os.environ if k.startswith(PREFIX)]:
                monkeypatch.delenv(key)
            for key, value in variables.items():
                if key not in pending:
                    monkeypatch.setenv(key, value)
            monkeypatch.setenv(f"{PREFIX}TOKEN_FILE", str(token))
            settings = DaemonSettings()
            assert settings.uds is not None and str(settings.uds.parent) == RUN_DIR


def test_variables_the_manifests_set_are_documented() -> None:
    guide = GUIDE.read_text()
    named = set(re.findall(rf"\b{PREFIX}[A-Z_]+\b", guide))
    used = {k for _, c in containers(DAEMON_IMAGE_CONTAINERS) for k in _variables(c)}
    assert used <= named, used - named
    from service.env import known_variables

    unknown = named - set(known_variables()) - set(PENDING_VARIABLES)
    assert not unknown, f"the guide names variables that configure nothing: {unknown}"


@pytest.mark.parametrize("pod", [p for p in PODS if p.container("daemon")], ids=pod_ids)
def test_daemon_flags_are_options_of_serve(pod: Pod) -> None:
    from weight_cache_cli import cli

    serve = cli.commands["serve"]
    options = {opt for param in serve.params for opt in param.opts + param.secondary_opts}
    daemon = pod.container("daemon")
    assert daemon is not None
    flags = {a for a in daemon["args"] if a.startswith("--")}
    assert flags and flags <= options, flags - options


@pytest.mark.parametrize("pod", [p for p in PODS if p.container("engine")], ids=pod_ids)
def test_engine_attaches_to_its_daemon(pod: Pod) -> None:
    """The engine's loader options are the loader's, and name the daemon of its topology: its
    socket in the shared run directory, its token, its model id, the same checkpoint and TP size.
    compose's engine uses the same load format."""
    from engine_client.loader_options import LoaderOptions

    engine = pod.container("engine")
    assert engine is not None
    args = engine["args"]
    extra = json.loads(arg_after(args, "--model-loader-extra-config"))
    LoaderOptions.model_validate(extra)
    assert arg_after(args, "--load-format") == "weight_cache"
    for service in compose_services(ENGINE_DOCKERFILE):
        if "--load-format" in service["command"]:
            assert arg_after(service["command"], "--load-format") == "weight_cache"
    daemons = [p.container("daemon") for p in PODS if p.topology == pod.topology]
    (daemon,) = [d for d in daemons if d is not None]
    variables = env_of(daemon)
    assert extra["uds"] == variables["WEIGHT_CACHE_UDS"]
    assert str(Path(extra["uds"]).parent) == variables["WEIGHT_CACHE_RUN_DIR"] == RUN_DIR
    assert extra["model"] == arg_after(daemon["args"], "--model-id")
    assert arg_after(args, "--served-model-name") == extra["model"]
    assert args[0] == arg_after(daemon["args"], "--model")  # the same checkpoint, same path
    assert arg_after(args, "--tensor-parallel-size") == arg_after(daemon["args"], "--tp-size")
    assert extra["fallback"] is True and extra["wait"] > 0


def test_readme_links_the_guide_and_names_the_probes() -> None:
    assert "(deploy/kubernetes/README.md)" in README.read_text()
    operating = OPERATING.read_text()
    assert "(../deploy/kubernetes/README.md)" in operating
    for text in (operating, GUIDE.read_text()):
        assert "`/health`" in text and "`/ready`" in text
