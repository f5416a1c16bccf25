"""After ``weight_cache`` loads a model, vLLM holds exactly what its default loader leaves:
every parameter, buffer and tensor attribute with the same class, dtype, shape, stride, device
and bytes, the same sharing (a tied LM head stays ``embed_tokens.weight``), the same loader and
plain attributes; and every leased tensor points into the daemon's arena.

Both loads run on vLLM's CPU platform with the CUTLASS kernel pinned (the kernel the daemon
processes for, as on Hopper), from one daemon process serving every variant, on what answers as a
plain AVX2 host (``cpu_capabilities``). vLLM's CPU attention backend takes an FP8 KV cache only
with AVX-512 or AMX, yet no attention kernel runs in a load: the KV-fp8 cases run with a stand-in
for AVX-512 on every host, and with the host's own answer where it has AVX-512. (AMX would also
select vLLM's packed GEMMs, whose ops its CUDA build lacks.)
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from torch.multiprocessing.spawn import start_processes

from harness.daemon_process import DaemonProcess, free_port, start_daemon
from harness.waiting import wait_for
from protocol.schemas.layout import CarriedKind
from tests.conftest import FIXTURES
from tests.vllm.cpu_capabilities import FP8_KV_CACHE_NEEDS, CpuView, current_view, viewing
from tests.vllm.model_state import model_state
from tests.vllm.variants import make_variant
from tests.vllm.vllm_model import configs, cutlass_kernel_on_cpu, vllm_world

EXPORTS = {
    "llama": "llama-fp8-kv",  # per-tensor FP8 with KV-cache scales
    "llama-pc": "llama-fp8-pc-pt-kv",  # per channel, with KV-cache scales
    "qwen2": "qwen2-fp8",  # per-tensor FP8, q/k/v biases
    "qwen3": "qwen3-fp8-pc-pt",  # per channel, q/k norms
}


@dataclass(frozen=True)
class Case:
    export: str
    tied: bool
    kv_scales: bool
    kv_cache_dtype: str
    tp: int = 1
    vocab: int | None = None  # cut the vocabulary so vLLM pads it

    @property
    def id(self) -> str:
        return (
            f"{self.export}-{'tied' if self.tied else 'untied'}-"
            f"{'kvscales' if self.kv_scales else 'nokvscales'}-kv{self.kv_cache_dtype}-tp{self.tp}"
            + (f"-vocab{self.vocab}" if self.vocab else "")
        )


def _cases() -> list[Case]:
    cases = [
        Case(export, tied, kv_scales, kv)
        for export, tied, kv_scales, kv in itertools.product(
            ("llama", "llama-pc"), (False, True), (True, False), ("auto", "fp8")
        )
    ]
    cases += [
        Case(export, tied, False, kv)
        for export, tied, kv in itertools.product(
            ("qwen2", "qwen3"), (False, True), ("auto", "fp8")
        )
    ]
    cases += [
        Case("llama", False, True, "auto", vocab=100),
        Case("qwen3", True, False, "fp8", vocab=100),
        Case("llama", True, True, "fp8", tp=2, vocab=100),
        Case("qwen3", False, False, "auto", tp=2),
    ]
    return cases


CASES = _cases()


def _params(cases: list[Case]) -> Sequence[object]:
    """Each case; a KV-fp8 one twice, standing in for AVX-512 and asking the host for it."""
    params = []
    for case in cases:
        if case.kv_cache_dtype == "fp8":
            params.append(pytest.param(case, True, id=f"{case.id}-standin"))
            marks = pytest.mark.host_capability(FP8_KV_CACHE_NEEDS)
            params.append(pytest.param(case, False, id=f"{case.id}-host", marks=marks))
        else:
            params.append(pytest.param(case, False, id=case.id))
    return params


def _view(stand_in: bool) -> CpuView:
    return current_view().claiming(FP8_KV_CACHE_NEEDS) if stand_in else current_view()


def _checkpoint_for(case: Case, root: Path) -> Path:
    name = f"{case.export}-{case.tied}-{case.kv_scales}-{case.vocab}"
    path = root / name
    if not path.exists():
        make_variant(
            FIXTURES / "modelopt" / EXPORTS[case.export],
            path,
            tied=case.tied,
            kv_scales=case.kv_scales,
            vocab=case.vocab,
        )
    return path


def _model_id(case: Case) -> str:
    return f"{case.export}-{int(case.tied)}-{int(case.kv_scales)}-{case.vocab or 0}-tp{case.tp}"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, Path]]:
    """One daemon holding every checkpoint variant at the TP sizes the cases use, all loading
    at once (past the default cap of concurrent loads)."""
    root = tmp_path_factory.mktemp("variants")
    daemon = start_daemon(
        tmp_path_factory.mktemp("daemon"),
        [],
        "--allowed-root",
        str(root),
        "--max-concurrent-loads",
        "64",
        wait_ready=False,
    )
    try:
        with httpx.Client(base_url=daemon.url, timeout=30) as http:
            wanted = {}
            for case in CASES:
                model_id = _model_id(case)
                if model_id not in wanted:
                    path = _checkpoint_for(case, root)
                    body = {"path": str(path), "id": model_id, "tp_size": case.tp}
                    r = http.post("/v1/models", json=body)
                    assert r.status_code in (200, 201, 202), r.text
                    wanted[model_id] = path

            def all_ready() -> bool:
                states = {m["id"]: m["state"] for m in http.get("/v1/models").json()}
                assert "failed" not in states.values(), states
                return all(states.get(m) == "ready" for m in wanted)

            wait_for(all_ready, timeout=120)
        yield daemon, root
    finally:
        daemon.stop()


def _load(case: Case, url: str, checkpoint: Path, load_format: str, rank: int, port: int):
    """(loader, model) of one load, as rank ``rank`` of a fresh TP world."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers import rotary_embedding
    from vllm.model_executor.model_loader import get_model_loader

    rotary_embedding._ROPE_DICT.clear()  # as in a fresh engine process
    extra = {"url": url, "model": _model_id(case), "fallback": False}
    vllm_config, model_config = configs(
        checkpoint,
        load_format=load_format,
        extra=extra if load_format == "weight_cache" else None,
        tp_size=case.tp,
        kv_cache_dtype=case.kv_cache_dtype,
    )
    with set_current_vllm_config(vllm_config), vllm_world(case.tp, rank, port):
        loader = get_model_loader(vllm_config.load_config)
        return loader, loader.load_model(vllm_config, model_config)


def _differences(
    case: Case, url: str, checkpoint: Path, rank: int, ports: tuple[int, int], view: CpuView
) -> list[str]:
    """Load ``checkpoint`` with vLLM's default loader and with ``weight_cache`` (fallback off)
    in this process, as rank ``rank``, on a host CPU answering as ``view``; return every
    difference, and every leased tensor that does not point into the arena."""
    import engine_client.vllm_plugin

    engine_client.vllm_plugin.register()
    with cutlass_kernel_on_cpu(), viewing(view):
        _, default_model = _load(case, url, checkpoint, "auto", rank, ports[0])
        loader, model = _load(case, url, checkpoint, "weight_cache", rank, ports[1])
    problems = model_state(default_model).differences(model_state(model))
    attachment = loader.attachment
    assert attachment is not None, "weight_cache fell back"
    arena = attachment.arena.base
    assert arena is not None
    start, end = arena.data_ptr(), arena.data_ptr() + arena.numel()
    params = dict(model.named_parameters(remove_duplicate=False))
    kept = {c.name for c in attachment.manifest.carried if c.kind is CarriedKind.checkpoint}
    leased = set(attachment.tensors) - kept
    assert leased, "nothing was leased"
    for name in sorted(leased):
        param = params.get(name)
        if param is None or not start <= param.data_ptr() < end:
            problems.append(f"{name} does not point into the arena")
    attachment.close()
    return problems


def _rank(
    rank: int,
    case: Case,
    url: str,
    checkpoint: str,
    ports: tuple[int, int],
    view: CpuView,
    out: str,
) -> None:
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    problems = _differences(case, url, Path(checkpoint), rank, ports, view)
    Path(out, f"rank{rank}.json").write_text(json.dumps(problems))


@pytest.mark.parametrize(("case", "stand_in"), _params([c for c in CASES if c.tp == 1]))
def test_state_equals_default_loader(
    case: Case, stand_in: bool, served: tuple[DaemonProcess, Path]
) -> None:
    daemon, root = served
    ports = (free_port(), free_port())
    checkpoint = _checkpoint_for(case, root)
    problems = _differences(case, daemon.url, checkpoint, 0, ports, _view(stand_in))
    assert problems == []


@pytest.mark.parametrize(("case", "stand_in"), _params([c for c in CASES if c.tp > 1]))
def test_state_equals_default_loader_per_rank(
    case: Case, stand_in: bool, served: tuple[DaemonProcess, Path], tmp_path: Path
) -> None:
    """Every rank, in its own process on gloo, compares its own shard."""
    daemon, root = served
    start_processes(
        _rank,
        args=(
            case,
            daemon.url,
            str(_checkpoint_for(case, root)),
            (free_port(), free_port()),
            _view(stand_in),
            str(tmp_path),
        ),
        nprocs=case.tp,
        join=True,
        start_method="spawn",
    )
    for rank in range(case.tp):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == [], rank


def test_comparison_sees_an_untied_head(served: tuple[DaemonProcess, Path]) -> None:
    """The comparison is not blind: a model whose tied LM head was given its own tensor (what
    the loader once did) differs from the default loader's, by name."""
    daemon, root = served
    case = Case("qwen3", True, False, "auto")
    with cutlass_kernel_on_cpu():
        _, model = _load(case, daemon.url, _checkpoint_for(case, root), "auto", 0, free_port())
    before = model_state(model)
    head = model.lm_head
    head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    after = model_state(model)
    assert any(d.startswith("sharing lm_head.weight") for d in before.differences(after))
