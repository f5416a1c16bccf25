"""`make test` on a fresh machine (as `make -n` shows it): everything it installs goes into
`.venv`, the deployment tools' environment or the vLLM environment, nothing into the system;
the vLLM environment gets a Python that vLLM 0.33 runs on, and without one the vLLM tests are
skipped, saying why."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SYSTEM_INSTALLERS = re.compile(r"\b(apt-get|apt|aptitude|dpkg|yum|dnf|apk|zypper|brew|snap|sudo)\b")
PIP_INSTALL = re.compile(r"(\S+?)(?: -m pip|/pip) install")


def _dry_run(tmp_path: Path, *variables: str, target: str = "test") -> list[str]:
    """The commands of `make TARGET` from scratch, into environments under ``tmp_path``."""
    make = shutil.which("make")
    assert make, "make runs the tests"
    environments = [
        f"VENV={tmp_path}/venv",
        f"VLLM_VENV={tmp_path}/vllm",
        f"DEPLOY_VENV={tmp_path}/deploy",
    ]
    out = subprocess.run(
        [make, "-n", "-B", target, *environments, *variables],
        cwd=ROOT,
        # not the flags of a `make test` this runs under
        env={k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")},
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_make_test_installs_only_into_its_environments(tmp_path: Path) -> None:
    lines = _dry_run(tmp_path)
    assert [line for line in lines if SYSTEM_INSTALLERS.search(line)] == []
    installers = [m.group(1) for line in lines for m in PIP_INSTALL.finditer(line)]
    assert installers, lines
    ours = [tmp_path / name / "bin" for name in ("venv", "vllm", "deploy")]
    assert all(any(Path(i).is_relative_to(env) for env in ours) for i in installers), installers
    assert any("vllm==0.33.0" in line for line in lines)  # the vLLM tests do run


def test_the_vllm_environment_gets_a_python_vllm_runs_on(tmp_path: Path) -> None:
    (made,) = [line for line in _dry_run(tmp_path) if line.endswith(f"-m venv {tmp_path}/vllm")]
    python = made.split(" -m venv ")[0]
    version = subprocess.run(
        [python, "-c", "import sys; print(*sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert (3, 11) <= tuple(map(int, version.stdout.split())) < (3, 15)


def test_without_such_a_python_the_vllm_tests_are_skipped(tmp_path: Path) -> None:
    lines = _dry_run(tmp_path, "VLLM_PYTHON=")
    assert not any("vllm==0.33.0" in line or "tests/vllm" in line for line in lines)
    assert "vLLM 0.33 needs Python 3.11 to 3.14 and there is none (set VLLM_PYTHON):" in lines


def test_make_demo_installs_only_into_the_vllm_environment_and_runs_the_demo(
    tmp_path: Path,
) -> None:
    """`make demo` on a fresh machine: the vLLM environment made as for the vLLM tests, nothing
    installed elsewhere, and the demo run on vLLM's CPU platform with the tests' view of the host
    CPU (tests/vllm/test_engine_demo.py runs that command)."""
    lines = _dry_run(tmp_path, target="demo")
    assert [line for line in lines if SYSTEM_INSTALLERS.search(line)] == []
    installers = [m.group(1) for line in lines for m in PIP_INSTALL.finditer(line)]
    assert installers and all(Path(i).is_relative_to(tmp_path / "vllm" / "bin") for i in installers)
    assert any("vllm==0.33.0" in line for line in lines)
    commands = "\n".join(lines).replace("\\\n", " ").splitlines()  # continued lines joined
    (run,) = [command for command in commands if "-m harness.engine_demo" in command]
    assert f'PYTHONPATH="{ROOT}/tests/vllm/startup:{ROOT}"' in run
    assert "VLLM_TARGET_DEVICE=cpu" in run and f"{tmp_path}/vllm/bin/python" in run
