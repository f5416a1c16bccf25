"""The host CPU as the vLLM tests see it: a plain AVX2 x86-64 machine, whatever they run on.

vLLM's CPU platform chooses from what the host CPU reports: the platform class, the kernel
library it loads, the FP8 and unquantized GEMM kernels, the attention ISA, whether an FP8 KV
cache is allowed at all. CI runs on one kind of machine, so here every such probe answers as on
the least capable host the tests support (AVX2; no AVX-512, AVX-VNNI or AMX), in every process
the tests start: ``tests/vllm/startup/sitecustomize.py`` calls :func:`install` at interpreter
start through ``PYTHONPATH``, which ``make test-vllm`` sets and :func:`install` passes on to
every process started after it (spawned TP ranks, the daemon).

A test that needs more says so: ``@pytest.mark.host_capability("avx512_f")`` runs it with the
host's own answer for that capability and skips it where the host lacks it
(``tests/vllm/conftest.py``); :meth:`CpuView.claiming` stands in for a capability where what a
test checks does not depend on the ISA it selects.

Every touch of torch's or vLLM's internals for this is here; :data:`PROBES` lists each host
probe in vLLM 0.33 outside ``torch.cpu`` and how it is answered, and
``tests/vllm/test_cpu_capabilities.py`` fails on a torch or vLLM where this stops holding.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import Any

import wrapt

# Where sitecustomize.py lives: on PYTHONPATH, it runs at the start of every process.
STARTUP = Path(__file__).resolve().parent / "startup"

# Set before torch starts: ATen's vectorised kernels dispatch as on an AVX2 host
# (torch.backends.cpu.get_cpu_capability() says AVX2), and vLLM's usage report, which reads
# py-cpuinfo, is never sent.
ENVIRONMENT = {"ATEN_CPU_CAPABILITY": "avx2", "VLLM_NO_USAGE_STATS": "1"}

# torch.cpu.get_capabilities() names (torch 2.14, x86-64) a plain AVX2 host has as its own.
AVX2_LEVEL = frozenset(
    {
        "sse", "sse2", "sse3", "ssse3", "sse4_1", "sse4_2", "sse4a", "avx", "avx2",
        "fma3", "fma4", "f16c", "bmi", "bmi2", "popcnt", "lzcnt", "aes", "sha",
        "clflush", "clflushopt", "clwb",
    }
)  # fmt: skip
# ... and those it lacks: each answers False unless a test claims it or asks the host.
ABOVE_AVX2 = frozenset(
    {
        "avx_vnni", "avx_vnni_int8", "avx_vnni_int16", "avx_ne_convert",
        "avx512_f", "avx512_cd", "avx512_dq", "avx512_bw", "avx512_vl", "avx512_ifma",
        "avx512_vbmi", "avx512_vbmi2", "avx512_bitalg", "avx512_vpopcntdq", "avx512_vnni",
        "avx512_bf16", "avx512_fp16", "avx512_vp2intersect", "avx512_4vnniw", "avx512_4fmaps",
        "avx10_1", "avx10_2", "amx_bf16", "amx_tile", "amx_int8", "amx_fp16",
    }
)  # fmt: skip

# What vLLM's CPU attention backend needs before it takes an FP8 KV cache (or amx_tile, which
# also selects packed GEMMs whose ops vLLM's CUDA build lacks).
FP8_KV_CACHE_NEEDS = "avx512_f"


@dataclass(frozen=True)
class Probe:
    """A place in vLLM that asks the host about its CPU other than through ``torch.cpu``."""

    module: str  # vllm's module, as a path under the package
    function: str  # the function that holds the probe ("<module>" at import)
    reads: str
    answer: str  # what the tests' processes get, and why


# Every place in vLLM 0.33's source that reads the host's CPU other than through torch.cpu
# (whose every probe is answered by the pinned torch.cpu.get_capabilities);
# test_cpu_capabilities scans vLLM for them and fails on any other.
_GPU_NUMA = "binds GPU workers to NUMA nodes on Granite Rapids (CUDA only): not the ISA"
_THREADS = "binds the CPU worker's threads (engine only): topology, not the ISA"
_USAGE = "vLLM's usage report only, which VLLM_NO_USAGE_STATS=1 turns off"
PROBES = (
    Probe("platforms/__init__.py", "_is_amd_zen_cpu", "/proc/cpuinfo: an AMD CPU with AVX-512",
          "pinned False, as on a plain AVX2 host: CpuPlatform, never ZenCpuPlatform"),
    Probe("_custom_ops.py", "cpu_has_amx_fp8", "vLLM's op cpu_has_amx_fp8: AMX-FP8 hardware",
          "pinned False, for the FP8 linear kernel choice and the CPU MoE alike"),
    Probe("v1/attention/backends/cpu_attn.py", "_riscv_supports_rvv",
          "/proc/cpuinfo and vLLM's op cpu_attn_has_isa: RISC-V vector length",
          "reached on RISC-V only"),
    Probe("platforms/cpu.py", "supported_dtypes", "sysctl hw.optional.arm.FEAT_BF16",
          "reached on macOS on ARM only"),
    Probe("platforms/cpu.py", "discover_numa_topology", "/sys/devices/system/cpu",
          "NIXL KV transfer only: topology, not the ISA"),
    Probe("utils/cpu_resource_utils.py", "_get_cpu_list", "lscpu", _THREADS),
    Probe("utils/numa_utils.py", "<module>", "/proc/cpuinfo, /sys/devices/system/cpu (paths its "
          "functions read)", _GPU_NUMA),
    Probe("usage/usage_lib.py", "<module>", "py-cpuinfo (imported)", _USAGE),
    Probe("usage/usage_lib.py", "_report_usage_once", "py-cpuinfo get_cpu_info()", _USAGE),
    Probe("collect_env.py", "get_cpu_info", "lscpu, sysctl", "`vllm collect-env` only"),
)  # fmt: skip


@dataclass(frozen=True)
class CpuView:
    """Which capabilities above AVX2 the probes report: ``claimed`` ones answer True (a stand-in
    for a host that has them), ``from_host`` ones answer as the host does, the rest False."""

    claimed: frozenset[str] = field(default_factory=frozenset)
    from_host: frozenset[str] = field(default_factory=frozenset)

    def claiming(self, *capabilities: str) -> CpuView:
        return replace(self, claimed=self.claimed | _known(capabilities))

    def asking_host(self, *capabilities: str) -> CpuView:
        return replace(self, from_host=self.from_host | _known(capabilities))

    def answer(self, name: str, host: object) -> object:
        """What the probe reports for capability ``name`` where the host says ``host``."""
        if not isinstance(host, bool) or name in AVX2_LEVEL:
            return host  # properties (cache sizes, cpu_name) and what an AVX2 host has
        if name in self.claimed:
            return True
        return host if name in self.from_host else False  # unknown flags count as above AVX2


PLAIN_AVX2 = CpuView()


def _known(capabilities: tuple[str, ...]) -> frozenset[str]:
    unknown = set(capabilities) - ABOVE_AVX2
    if unknown:
        raise ValueError(f"not a capability above AVX2 (torch.cpu names): {sorted(unknown)}")
    return frozenset(capabilities)


@dataclass
class _State:
    view: CpuView = PLAIN_AVX2
    host_capabilities: Callable[[], Mapping[str, Any]] | None = None  # torch's own
    installed: bool = False
    at_interpreter_start: bool = False  # by sitecustomize, before anything ran a torch kernel


_state = _State()


def current_view() -> CpuView:
    return _state.view


def installed_at_interpreter_start() -> bool:
    return _state.at_interpreter_start


@contextlib.contextmanager
def viewing(view: CpuView) -> Iterator[None]:
    """The probes answer as ``view`` says inside the block (this process only; a spawned
    process is handed :func:`current_view` and enters it itself)."""
    saved, _state.view = _state.view, view
    try:
        yield
    finally:
        _state.view = saved


def host_capabilities() -> Mapping[str, Any]:
    """What torch reports for the real host, unpinned."""
    importlib.import_module("torch.cpu")  # its hook keeps torch's own function
    assert _state.host_capabilities is not None, "install() was not called"
    return _state.host_capabilities()


def host_has(capability: str) -> bool:
    return bool(host_capabilities().get(capability, False))


def _capabilities() -> Mapping[str, Any]:
    host = host_capabilities()
    view = _state.view
    return MappingProxyType({name: view.answer(name, value) for name, value in host.items()})


def _replace(module: ModuleType, name: str, value: Callable[[], Any]) -> Callable[[], Any]:
    """Put ``value`` in place of ``module.name``; return what was there."""
    replaced: Callable[[], Any] | None = getattr(module, name, None)
    if replaced is None or not callable(replaced):
        raise RuntimeError(
            f"{module.__name__}.{name} is gone: tests/vllm/cpu_capabilities.py pins it, so the "
            "vLLM tests would see this host's CPU; find what replaced it and pin that"
        )
    setattr(module, name, value)
    return replaced


def _pin_torch(module: ModuleType) -> None:
    # Every torch.cpu._is_*_supported() reads get_capabilities(), as vLLM does directly.
    _state.host_capabilities = _replace(module, "get_capabilities", _capabilities)


def _not_on_a_plain_avx2_host() -> bool:
    return False


def _pin_vllm_platforms(module: ModuleType) -> None:
    _replace(module, "_is_amd_zen_cpu", _not_on_a_plain_avx2_host)


def _pin_vllm_ops(module: ModuleType) -> None:
    # Before vLLM's modules that import it by name (fused_moe's cpu_moe) are imported.
    _replace(module, "cpu_has_amx_fp8", _not_on_a_plain_avx2_host)


def install(*, at_interpreter_start: bool = False) -> None:
    """Pin every probe in this process (as each module is imported) and in every process
    started from it. Call it before torch runs a kernel: at interpreter start."""
    _state.at_interpreter_start |= at_interpreter_start
    os.environ.update(ENVIRONMENT)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(STARTUP) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(STARTUP), *filter(None, paths)])
    if _state.installed:
        return
    _state.installed = True
    wrapt.register_post_import_hook(_pin_torch, "torch.cpu")
    wrapt.register_post_import_hook(_pin_vllm_platforms, "vllm.platforms")
    wrapt.register_post_import_hook(_pin_vllm_ops, "vllm._custom_ops")


def answers() -> dict[str, Any]:
    """What the host probes on the vLLM tests' paths answer in this process (JSON-able)."""
    import torch
    import vllm.envs
    import vllm.platforms
    from vllm import _custom_ops
    from vllm.model_executor.kernels import linear
    from vllm.model_executor.layers.utils import check_cpu_sgl_kernel
    from vllm.platforms import PlatformEnum
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    capabilities = torch.cpu.get_capabilities()
    probes = [n for n in dir(torch.cpu) if n.startswith("_is_") and n.endswith("_supported")]
    fp8_kernels = linear._POSSIBLE_FP8_KERNELS[PlatformEnum.CPU]
    return {
        # every torch.cpu._is_*_supported() reads these, and vLLM reads them directly too
        "capabilities above AVX2": sorted(
            n for n, v in capabilities.items() if v is True and n not in AVX2_LEVEL
        ),
        "torch.cpu probes": {n: getattr(torch.cpu, n)() for n in sorted(probes)},
        "ATen kernels": torch.backends.cpu.get_cpu_capability(),
        # vLLM: the platform (/proc/cpuinfo), its kernel library and config (torch.cpu), ...
        "platform": type(vllm.platforms.current_platform).__name__,
        "AMD Zen with AVX-512": vllm.platforms._is_amd_zen_cpu(),
        # ... the CPU attention backend, which refuses an FP8 KV cache without AVX-512 or AMX,
        "FP8 KV cache": CPUAttentionBackend.supports_kv_cache_dtype("fp8"),
        # ... the unquantized GEMM of embeddings and LM heads (AMX: packed weights),
        "packed GEMM": check_cpu_sgl_kernel(64, 64, torch.bfloat16),
        # ... the FP8 linear kernel (AMX, AMX-FP8),
        "AMX-FP8": _custom_ops.cpu_has_amx_fp8(),
        "FP8 linear kernels": {k.__name__: k.is_supported()[0] for k in fp8_kernels},
        # ... and its usage report (py-cpuinfo).
        "usage report": not vllm.envs.VLLM_NO_USAGE_STATS,
    }
