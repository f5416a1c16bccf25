"""Build both images and smoke-test them: ``python docker/images.py`` (``make images``).

Where no Docker daemon answers, it says so and exits 0 having built nothing. Otherwise it builds
``weight-cache:VERSION`` (docker/Dockerfile) and ``vllm-weight-cache:VERSION``
(docker/Dockerfile.vllm), VERSION being the package's, the tags compose and the Kubernetes
manifests name, and checks each: the vLLM inside is the pinned one (the torch and CUDA it
carries are printed), the daemon serves its demo model on the CPU until ``/ready`` and carries
the Kubernetes pods' prerequisites check (which names a missing Secret), the engine
image's vLLM has the ``weight_cache`` load format. No GPU is needed for any of it. Exit status 1
when a build or a check fails.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def version() -> str:
    """The package's version (protocol/version.py), read without importing the package."""
    text = (ROOT / "protocol" / "version.py").read_text()
    found = re.search(r'^__version__ = "([^"]+)"', text, re.M)
    assert found, "protocol/version.py names no __version__"
    return found.group(1)


def pinned(package: str) -> str:
    """The version constraints.txt pins ``package`` to."""
    found = re.search(
        rf"^{re.escape(package)}==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M
    )
    assert found, f"constraints.txt pins no {package}"
    return found.group(1)


def images() -> dict[str, str]:
    """Tag -> Dockerfile: the images compose builds and the Kubernetes manifests run."""
    return {
        f"weight-cache:{version()}": "docker/Dockerfile",
        f"vllm-weight-cache:{version()}": "docker/Dockerfile.vllm",
    }


def base_image() -> str:
    return f"vllm/vllm-openai:v{pinned('vllm')}"


def docker_daemon(docker: str | None) -> str | None:
    """Why no image can be built here, or None when a Docker daemon answers."""
    if docker is None:
        return "no docker command on PATH"
    info = subprocess.run(
        [docker, "info", "--format", "{{.ServerVersion}}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if info.returncode != 0:
        lines = (info.stderr or info.stdout).strip().splitlines()
        return f"no Docker daemon answers ({lines[-1] if lines else 'docker info failed'})"
    return None


def run(*args: str) -> str:
    print("+", " ".join(args), flush=True)
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{done.stdout}{done.stderr}")
    return done.stdout


def smoke_daemon(docker: str, tag: str) -> None:
    """The daemon image serves its demo model on the CPU until /ready, as its user."""
    name = f"weight-cache-smoke-{uuid.uuid4().hex[:8]}"
    run(docker, "run", "-d", "--name", name, "-e", "WEIGHT_CACHE_HOST=127.0.0.1", tag,
        "--device", "cpu", "--keeper", "off")  # fmt: skip
    probe = (
        "import urllib.request; "
        "print(urllib.request.urlopen('http://127.0.0.1:8470/ready', timeout=2).status)"
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            done = subprocess.run(
                [docker, "exec", name, "python3", "-c", probe],
                capture_output=True,
                text=True,
                check=False,
            )
            if done.stdout.strip() == "200":
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{tag}: /ready never answered 200:\n{run(docker, 'logs', name)}"
                )
            time.sleep(2)
        assert run(docker, "exec", name, "id", "-u").strip() == "10001", "not the image's user"
    finally:
        subprocess.run([docker, "rm", "-f", name], capture_output=True, check=False)


def smoke_prerequisites(docker: str, tag: str) -> None:
    """The daemon image carries the Kubernetes pods' prerequisites check where they run it, and
    the check names a missing Secret."""
    done = subprocess.run(
        [docker, "run", "--rm", "--entrypoint", "python3", tag,
         "/opt/weight-cache/check_prerequisites.py", "--token-file", "/nonexistent/token"],
        capture_output=True,
        text=True,
        check=False,
    )  # fmt: skip
    said = done.stdout + done.stderr
    assert done.returncode == 1 and "weight-cache-token" in said, f"{tag}: prerequisites: {said}"


def smoke_versions(docker: str, tag: str, engine: bool) -> None:
    """vLLM as pinned (and, in the engine image, the loader's registration) inside the image;
    the torch and CUDA it carries are printed."""
    code = (
        "import importlib.metadata as m, torch; "
        "print(m.version('vllm'), torch.__version__, torch.version.cuda)"
    )
    if engine:
        code += (
            "; eps = m.entry_points(group='vllm.general_plugins'); "
            "assert 'weight_cache' in [e.name for e in eps], 'no weight_cache plugin'"
        )
    out = run(docker, "run", "--rm", "--entrypoint", "python3", tag, "-c", code).split()
    assert out[0] == pinned("vllm"), f"{tag}: vLLM {out[0]}, constraints.txt pins {pinned('vllm')}"
    print(f"{tag}: vLLM {out[0]}, torch {out[1]}, CUDA {out[2]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-smoke", action="store_true", help="build only")
    args = parser.parse_args(argv)
    docker = shutil.which("docker")
    why = docker_daemon(docker)
    if why is not None:
        print(f"skipped: {why}; built none of {', '.join(images())}")
        return 0
    assert docker is not None
    try:
        for tag, dockerfile in images().items():
            run(docker, "build", "-f", str(ROOT / dockerfile), "-t", tag,
                "--build-arg", f"VLLM_IMAGE={base_image()}", str(ROOT))  # fmt: skip
        if not args.no_smoke:
            daemon_tag, engine_tag = images()
            smoke_versions(docker, daemon_tag, engine=False)
            smoke_versions(docker, engine_tag, engine=True)
            smoke_daemon(docker, daemon_tag)
            smoke_prerequisites(docker, daemon_tag)
    except (RuntimeError, AssertionError) as exc:
        print(f"failed: {exc}", file=sys.stderr)
        return 1
    print(f"built and checked {', '.join(images())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
