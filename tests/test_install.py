"""The package installs as the README says, from a built wheel (``make dist``): its extras are the
ones the README names, the wheel alone gives the ``weight-cache`` command and the vLLM plugin's
entry point, and the extras this environment can satisfy resolve."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from harness.python_child import run_python
from protocol.version import __version__

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
WHEEL = f"weight_cache-{__version__}-py3-none-any.whl"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel `make dist` builds (the same pip command), from this checkout."""
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )  # fmt: skip
    assert (
        "$(PIP) wheel -q --no-deps --no-build-isolation -w dist ."
        in (ROOT / "Makefile").read_text()
    )
    return out / WHEEL


def _metadata(wheel: Path) -> tuple[set[str], str]:
    with zipfile.ZipFile(wheel) as archive:
        meta = archive.read(f"weight_cache-{__version__}.dist-info/METADATA").decode()
        entry_points = archive.read(f"weight_cache-{__version__}.dist-info/entry_points.txt")
    extras = set(Parser().parsestr(meta).get_all("Provides-Extra") or [])
    return extras, entry_points.decode()


def test_the_wheel_has_the_extras_and_entry_points_the_readme_names(wheel: Path) -> None:
    extras, entry_points = _metadata(wheel)
    readme = README.read_text()
    installs = " ".join(re.findall(r"pip install [^\n#]*", readme))
    named = set(re.findall(r"\[(\w+)\]", installs))
    table = set(re.findall(r"^\| `(\w+)` \|", readme, re.M))
    assert named and named <= extras, named - extras
    assert table == extras == {"daemon", "cuda", "vllm", "test"}
    assert f"dist/{WHEEL}" in installs and "make dist" in readme
    assert "weight-cache = weight_cache_cli:main" in entry_points
    assert "weight_cache = engine_client.vllm_plugin:register" in entry_points


def test_the_wheel_alone_runs(wheel: Path, tmp_path: Path) -> None:
    """Installed from the wheel (not the checkout), the command and the engine side import."""
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
         str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )  # fmt: skip
    code = (
        "import weight_cache_cli, engine_client.loader_options as o; "
        "print(weight_cache_cli.__file__); print(o.__file__)"
    )
    out = run_python(code, cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert all(line.startswith(str(site)) for line in out.stdout.splitlines()), out.stdout
    version = subprocess.run(
        [sys.executable, "-m", "weight_cache_cli", "--version"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
    )
    assert version.stdout.strip() == f"weight-cache, version {__version__}"


@pytest.mark.parametrize("extras", ["daemon", "daemon,test"])
def test_the_extras_resolve(wheel: Path, extras: str) -> None:
    """pip accepts the extras and finds everything they need (here, installed already; no
    index asked), as `make run` and `make test` install them."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index",
         "--find-links", str(wheel.parent), f"weight-cache[{extras}]"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "does not provide the extra" not in out.stdout + out.stderr
