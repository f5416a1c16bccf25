"""The vLLM tests see a plain AVX2 x86-64 host in every process, whatever they run on; a test
can stand in for a capability or ask the host for it; and this fails on a torch or vLLM that
probes the host some other way."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import types
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.spawn import start_processes

from harness.python_child import run_python
from tests.vllm import cpu_capabilities
from tests.vllm.cpu_capabilities import (
    ABOVE_AVX2,
    AVX2_LEVEL,
    FP8_KV_CACHE_NEEDS,
    PLAIN_AVX2,
    PROBES,
    STARTUP,
    answers,
    current_view,
    host_capabilities,
    host_has,
    installed_at_interpreter_start,
    viewing,
)

# What a plain AVX2 host answers (vLLM 0.33.0's CUDA wheel, torch 2.14).
PLAIN_AVX2_ANSWERS = {
    "capabilities above AVX2": [],
    "torch.cpu probes": {
        "_is_amx_fp16_supported": False,
        "_is_amx_tile_supported": False,
        "_is_avx2_supported": True,
        "_is_avx512_bf16_supported": False,
        "_is_avx512_supported": False,
        "_is_vnni_supported": False,
    },
    "ATen kernels": "AVX2",
    "platform": "CpuPlatform",
    "AMD Zen with AVX-512": False,
    "FP8 KV cache": False,  # the refusal a plain AVX2 host gives (issue 19)
    "packed GEMM": False,
    "AMX-FP8": False,
    "FP8 linear kernels": {
        "CPUFP8W8A8ScaledMMLinearKernel": False,
        "CPUFp8PerTensorScaledMMLinearKernel": False,
        "CPUFp8ChannelWiseScaledMMLinearKernel": False,
        "PerTensorTorchFP8ScaledMMLinearKernel": True,
        "ChannelWiseTorchFP8ScaledMMLinearKernel": True,
    },
    "usage report": False,
}


def _answers_to(rank: int, out: str) -> None:
    answered = {"at start": installed_at_interpreter_start(), **answers()}
    Path(out, "answers.json").write_text(json.dumps(answered))


def test_every_process_sees_a_plain_avx2_host(tmp_path: Path) -> None:
    """Here and in a process spawned as the TP ranks are (which runs no conftest)."""
    assert installed_at_interpreter_start(), (
        "run the vLLM tests with PYTHONPATH=tests/vllm/startup (make test-vllm does): without "
        "it torch chose its kernels for this host's CPU before the conftest pinned the rest"
    )
    assert current_view() == PLAIN_AVX2
    assert answers() == PLAIN_AVX2_ANSWERS
    start_processes(_answers_to, args=(str(tmp_path),), nprocs=1, start_method="spawn")
    spawned = json.loads((tmp_path / "answers.json").read_text())
    assert spawned == {"at start": True, **PLAIN_AVX2_ANSWERS}


def test_the_start_hook_keeps_the_sitecustomize_it_hides(tmp_path: Path) -> None:
    """A fresh interpreter (as the daemon the tests start) runs ours, then the one after it on
    the path, which it would otherwise hide."""
    theirs = tmp_path / "sitecustomize.py"
    theirs.write_text("import os\nos.environ['THEIRS_RAN'] = '1'\n")
    code = (
        "import os, sys; from tests.vllm import cpu_capabilities as c; "
        "print(c._state.installed, os.environ.get('THEIRS_RAN'), os.environ['PYTHONPATH'])"
    )
    out = run_python(
        code, env={**os.environ, "PYTHONPATH": f"{STARTUP}{os.pathsep}{tmp_path}"}, cwd=tmp_path
    )
    assert out.stdout.split() == ["True", "1", f"{STARTUP}{os.pathsep}{tmp_path}"]


def test_a_stand_in_claims_a_capability_for_this_process() -> None:
    with viewing(current_view().claiming(FP8_KV_CACHE_NEEDS)):
        claimed = answers()
        assert torch.cpu._is_avx512_supported()
    assert claimed["capabilities above AVX2"] == [FP8_KV_CACHE_NEEDS]
    assert claimed["FP8 KV cache"] is True  # what the KV-fp8 state-identity cases stand in for
    assert claimed["packed GEMM"] is False  # AVX-512 alone selects no other kernel
    assert answers() == PLAIN_AVX2_ANSWERS  # and only inside the block


def test_every_torch_probe_reads_the_pinned_capabilities() -> None:
    """Pinned or claimed, each torch.cpu._is_*_supported() follows: a torch whose probes stop
    reading get_capabilities() answers the host's value in one of the two."""
    with viewing(PLAIN_AVX2.claiming(*ABOVE_AVX2)):
        assert all(answers()["torch.cpu probes"].values())
    assert not any(
        value
        for name, value in answers()["torch.cpu probes"].items()
        if name != "_is_avx2_supported"
    )


def test_asking_the_host_gives_its_own_answers() -> None:
    host = host_capabilities()
    asked = sorted(ABOVE_AVX2)
    with viewing(PLAIN_AVX2.asking_host(*asked)):
        seen = torch.cpu.get_capabilities()
    assert {name: seen.get(name) for name in asked} == {name: host.get(name) for name in asked}
    assert seen["avx2"] is host["avx2"] is True  # the tests assume an AVX2 host


@pytest.mark.host_capability("avx512_f")
def test_the_marker_runs_a_test_with_the_hosts_answer() -> None:
    assert current_view().from_host == {"avx512_f"}
    assert host_has("avx512_f") and torch.cpu._is_avx512_supported()
    assert answers()["FP8 KV cache"] is True


def test_capability_names_are_checked() -> None:
    with pytest.raises(ValueError, match="avx512"):
        PLAIN_AVX2.claiming("avx512")  # torch's name is avx512_f
    with pytest.raises(ValueError, match="avx2"):
        PLAIN_AVX2.asking_host("avx2")  # every host the tests support has it


def test_torch_reports_no_capability_this_does_not_classify() -> None:
    flags = {name for name, value in host_capabilities().items() if isinstance(value, bool)}
    assert flags - AVX2_LEVEL - ABOVE_AVX2 == set()
    assert "avx2" in flags and "avx512_f" in flags and "amx_tile" in flags


def test_a_pinned_function_that_is_gone_stops_the_import() -> None:
    module = types.ModuleType("vllm.platforms")
    with pytest.raises(RuntimeError, match=r"vllm\.platforms\._is_amd_zen_cpu is gone"):
        cpu_capabilities._pin_vllm_platforms(module)


# Where vLLM reads the host's CPU other than through torch.cpu: files, commands, py-cpuinfo,
# torch's C probes, and ops of its own that ask the hardware (cpu_has_amx_fp8, ...).
READS = re.compile(r"/proc/cpuinfo|/sys/devices/system/cpu|\blscpu\b|\bsysctl\b|^cpu_\w*has_\w+$")
# Files that mention none of these are not parsed.
MENTIONS = re.compile(
    r"cpuinfo|/sys/devices/system/cpu|lscpu|sysctl|_C\._cpu|get_cpu_capability|platform\.processor"
    r"|cpu_\w*has_"
)
CALLS = re.compile(
    r"^torch\._C\._cpu\b|get_cpu_capability$|^platform\.processor$|\._C\.cpu_\w*has_"
)


def _dotted(node: ast.expr) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _reads_the_host(node: ast.AST, docstrings: set[int]) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return id(node) not in docstrings and READS.search(node.value) is not None
    if isinstance(node, ast.Attribute):
        dotted = _dotted(node)
        return CALLS.search(dotted) is not None or dotted.startswith("cpuinfo.")
    if isinstance(node, ast.Import | ast.ImportFrom):
        names = {a.name for a in node.names}
        return "cpuinfo" in names or getattr(node, "module", None) == "cpuinfo"
    return False


def _probe_sites(source: str) -> set[str]:
    """Names of the functions (``<module>`` for module level) in ``source`` that read the host."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    sites = set()

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            if _reads_the_host(child, docstrings):
                sites.add(function)
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child, child.name)
            else:
                visit(child, function)

    visit(tree, "<module>")
    return sites


def test_vllm_reads_the_host_cpu_nowhere_else() -> None:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    package = Path(spec.origin).parent
    found = set()
    for path in package.rglob("*.py"):
        source = path.read_text(encoding="utf-8")
        if "tests" not in path.relative_to(package).parts and MENTIONS.search(source):
            module = path.relative_to(package).as_posix()
            found |= {(module, function) for function in _probe_sites(source)}
    assert found == {(p.module, p.function) for p in PROBES}


def test_the_scan_sees_a_probe() -> None:
    source = 'def f():\n    """not this: /proc/cpuinfo"""\n    return open("/proc/cpuinfo")\n'
    assert _probe_sites(source) == {"f"}
    assert _probe_sites("import torch\nx = torch._C._cpu._is_avx512_supported()\n") == {"<module>"}
    assert _probe_sites('def f():\n    """/proc/cpuinfo"""\n') == set()
