"""Donated models on vLLM's CPU platform: a bf16 checkpoint the daemon does not process is
loaded by the first engine with vLLM's default loader and donated; the next engine attaches to
it. Both hold exactly what vLLM's default loader leaves (every parameter, buffer and tensor
attribute, by bytes; sharing; every plain and callable attribute of every module, quant method
and kernel), and every tensor of both points into the daemon's arena. Run as engines (``LLM``,
each in its own process), a donor and an attacher generate the default loader's tokens."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from engine_client.attach import attach
from engine_client.client import ClientConfig
from engine_client.donations import donate
from engine_client.verify import Expectations
from harness.checkpoint_tools import dequantized
from harness.daemon_process import DaemonProcess, free_port, start_daemon
from harness.donating import key_for
from harness.engine_demo import run_engine
from protocol.reasons import Reason
from protocol.schemas.donated import DONATED_KERNEL, DonationKey
from service.demo import write_demo_checkpoint
from tests.conftest import FIXTURES
from tests.vllm.model_state import ModelState, model_state
from tests.vllm.vllm_model import configs, vllm_world

SOURCES = {"llama": "llama-fp8-kv", "qwen2": "qwen2-fp8"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bf16")
    return {
        name: dequantized(FIXTURES / "modelopt" / source, root / name)
        for name, source in SOURCES.items()
    }


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    process = start_daemon(tmp_path, [], wait_ready=False, timeout_s=240)
    yield process
    process.stop()


def _load(
    checkpoint: Path,
    load_format: str,
    url: str | None = None,
    max_model_len: int = 256,
    **extra: Any,
) -> Any:
    """(loader, model) of one load in a fresh TP world of one."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers import rotary_embedding
    from vllm.model_executor.model_loader import get_model_loader

    import engine_client.vllm_plugin

    engine_client.vllm_plugin.register()
    rotary_embedding._ROPE_DICT.clear()  # as in a fresh engine process
    options = {"url": url, "fallback": False, **extra} if load_format == "weight_cache" else None
    vllm_config, model_config = configs(checkpoint, load_format=load_format, extra=options)
    model_config.max_model_len = max_model_len
    with set_current_vllm_config(vllm_config), vllm_world(1, 0, free_port()):
        loader = get_model_loader(vllm_config.load_config)
        return loader, loader.load_model(vllm_config, model_config)


def _outside_arena(model: torch.nn.Module, loader: Any) -> list[str]:
    """Every tensor of ``model`` that does not point into the arena ``loader`` leased."""
    arena = loader.attachment.arena.base
    start, end = arena.data_ptr(), arena.data_ptr() + arena.numel()
    outside = []
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        tensors = {**module._parameters, **module._buffers}
        tensors.update({k: v for k, v in vars(module).items() if isinstance(v, torch.Tensor)})
        held = {k: v for k, v in tensors.items() if isinstance(v, torch.Tensor) and v.numel()}
        outside += [prefix + k for k, v in held.items() if not start <= v.data_ptr() < end]
    return outside


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_donor_and_attacher_equal_the_default_loader(
    name: str, checkpoints: dict[str, Path], daemon: DaemonProcess
) -> None:
    checkpoint = checkpoints[name]
    _, default = _load(checkpoint, "auto")
    expected = model_state(default)
    del default

    donor_loader, donor = _load(checkpoint, "weight_cache", daemon.url)
    assert donor_loader.donated is not None, donor_loader.donation_error
    assert expected.differences(model_state(donor)) == []
    assert _outside_arena(donor, donor_loader) == []

    attacher_loader, attacher = _load(checkpoint, "weight_cache", daemon.url)
    assert attacher_loader.donated is None, "the second engine donated again"
    assert attacher_loader.attachment.manifest.model == donor_loader.donated
    assert expected.differences(model_state(attacher)) == []
    assert _outside_arena(attacher, attacher_loader) == []

    with httpx.Client(base_url=daemon.url) as http:
        donated = [m for m in http.get("/v1/models").json() if m["donor"] is not None]
    assert [m["id"] for m in donated] == [donor_loader.donated]
    assert donated[0]["active_leases"] == 2  # the donor's own and the attacher's
    assert donated[0]["donor"]["pid"] == os.getpid()
    donor_loader.attachment.close()
    attacher_loader.attachment.close()


def test_engines_donate_then_attach_and_generate_the_default_loaders_tokens(
    tmp_path: Path, daemon: DaemonProcess
) -> None:
    """Three ``LLM`` engines, each in its own process, on the demo's bf16 checkpoint: vLLM's
    default loader, then a ``weight_cache`` engine that donates its load, then one that attaches
    to that donation. Greedy tokens equal, neither falls back, and the daemon holds one donated
    model."""
    checkpoint = write_demo_checkpoint(tmp_path / "bf16", "bf16", "tiny")
    default = run_engine(checkpoint, None, tmp_path / "default.log")
    donor = run_engine(checkpoint, daemon.url, tmp_path / "donor.log")
    attacher = run_engine(checkpoint, daemon.url, tmp_path / "attacher.log")

    assert len(default.tokens) > 0
    assert donor.tokens == default.tokens
    assert attacher.tokens == default.tokens
    assert donor.fallback is None and attacher.fallback is None, (donor, attacher)
    assert donor.donated is not None and attacher.donated is None
    with httpx.Client(base_url=daemon.url) as http:
        (donated,) = [m for m in http.get("/v1/models").json() if m["donor"] is not None]
    assert donated["id"] in donor.donated
    assert attacher.attached is not None
    assert attacher.attached.startswith(f"weight-cache: attached donated model {donated['id']} (")


def test_an_engine_start_reads_the_keys_checkpoint_digests_once(
    checkpoints: dict[str, Path], daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM asks the loader for the weights held outside the engine, then loads: both need the
    donated key's checkpoint digests, read from the files once per engine start."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    import engine_client.vllm_plugin
    from engine_client.vllm.donated import KEY_TIERS
    from modelopt_fp8.checkpoint.fingerprint import checkpoint_fingerprint as fingerprint

    engine_client.vllm_plugin.register()
    read: list[object] = []

    def counted(directory: Path, tier: Any, headers: Any = None) -> Any:
        read.append(tier)
        return fingerprint(directory, tier, headers)

    monkeypatch.setattr("engine_client.vllm.engine_start.checkpoint_fingerprint", counted)
    options = {"url": daemon.url, "fallback": False}
    vllm_config, model_config = configs(
        checkpoints["llama"], load_format="weight_cache", extra=options
    )
    model_config.max_model_len = 256
    with set_current_vllm_config(vllm_config), vllm_world(1, 0, free_port()):
        assert get_model_loader(vllm_config.load_config).daemon_rank_bytes(vllm_config) == 0
        loader = get_model_loader(vllm_config.load_config)
        loader.load_model(vllm_config, model_config)
    assert loader.donated is not None, loader.donation_error
    assert sorted(map(str, read)) == sorted(map(str, KEY_TIERS))

    # The next engine start counts the donated model it will attach to as held outside it.
    vllm_config, model_config = configs(
        checkpoints["llama"], load_format="weight_cache", extra=options
    )
    model_config.max_model_len = 256
    with set_current_vllm_config(vllm_config), vllm_world(1, 0, free_port()):
        held = get_model_loader(vllm_config.load_config).daemon_rank_bytes(vllm_config)
    with httpx.Client(base_url=daemon.url) as http:
        (donated,) = [m for m in http.get("/v1/models").json() if m["id"] == loader.donated]
    assert held == donated["bytes_resident"] > 0
    loader.attachment.close()


def test_with_the_daemon_down_an_engine_loads_its_own(checkpoints: dict[str, Path]) -> None:
    """No daemon to ask for a donation: the engine loads what vLLM's default loader loads and
    says why it does not share; with ``fallback`` off it raises why instead."""
    from protocol.errors import DaemonUnavailableError

    checkpoint = checkpoints["llama"]
    _, default = _load(checkpoint, "auto")
    expected = model_state(default)
    del default
    url = f"http://127.0.0.1:{free_port()}"
    loader, model = _load(checkpoint, "weight_cache", url, fallback=True)
    assert loader.fallback_reason == Reason.daemon_unavailable
    assert loader.attachment is None and loader.donated is None
    assert expected.differences(model_state(model)) == []
    with pytest.raises(DaemonUnavailableError):
        _load(checkpoint, "weight_cache", url)


def test_a_failure_of_vllms_own_load_is_not_chained_onto_the_daemons_error(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's own load failing after the daemon could not be asked: its error is raised as it
    is, not chained onto the daemon's (nor onto the checkpoint not being a ModelOpt export),
    and its last line names the fallback."""
    import traceback

    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    def fails(self: Any, model: Any, model_config: Any) -> None:
        raise RuntimeError("vLLM's own load stopped")

    monkeypatch.setattr(DefaultModelLoader, "load_weights", fails)
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RuntimeError, match="own load stopped") as raised:
        _load(checkpoints["llama"], "weight_cache", url, fallback=True)
    error = raised.value
    assert error.__cause__ is None and error.__context__ is None
    printed = "".join(traceback.format_exception(error))
    assert "DaemonUnavailableError" not in printed and "NotModelOpt" not in printed
    assert printed.rstrip().splitlines()[-1] == (
        "weight-cache had fallen back to vLLM's default loader (daemon_unavailable); this "
        "error is that loader's own"
    )


def test_the_comparison_sees_one_attribute(checkpoints: dict[str, Path]) -> None:
    """The state compared is not blind to a plain attribute processing set on one layer."""
    _, model = _load(checkpoints["llama"], "auto")
    before: ModelState = model_state(model)
    model.model.layers[0].mlp.down_proj.processed_marker = 1
    assert before.differences(model_state(model)) == [
        "attribute model.layers.0.mlp.down_proj.processed_marker: None != '1'"
    ]


def _marking(monkeypatch: pytest.MonkeyPatch, mark: Any) -> None:
    """vLLM's processing of unquantized linear layers, made to set one attribute more."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    processing = UnquantizedLinearMethod.process_weights_after_loading

    def process(self: Any, layer: torch.nn.Module) -> None:
        processing(self, layer)
        layer.set_by_processing = mark
        self.method_state = (3, "three")

    monkeypatch.setattr(UnquantizedLinearMethod, "process_weights_after_loading", process)


def test_attributes_processing_sets_reach_the_attacher(
    checkpoints: dict[str, Path], daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An attacher runs no processing: what processing set on a layer and on its quant method
    comes with the donation, so its state still equals the default loader's."""
    _marking(monkeypatch, 7)
    checkpoint = checkpoints["llama"]
    _, default = _load(checkpoint, "auto")
    expected = model_state(default)
    assert expected.attributes["model.layers.0.mlp.down_proj.set_by_processing"] == "7"
    donor_loader, _ = _load(checkpoint, "weight_cache", daemon.url)
    attacher_loader, attacher = _load(checkpoint, "weight_cache", daemon.url)
    assert donor_loader.donated is not None, donor_loader.donation_error
    assert attacher_loader.donated is None and attacher_loader.attachment is not None
    assert expected.differences(model_state(attacher)) == []
    donor_loader.attachment.close()
    attacher_loader.attachment.close()


def test_a_callable_processing_sets_that_cannot_be_rebuilt_is_not_donated(
    checkpoints: dict[str, Path], daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine keeps its own load, says which attribute stopped the donation, and the daemon
    holds nothing of it."""
    _marking(monkeypatch, lambda x: x)
    checkpoint = checkpoints["llama"]
    _, default = _load(checkpoint, "auto")
    loader, model = _load(checkpoint, "weight_cache", daemon.url)
    assert loader.donated is None and loader.attachment is None
    assert loader.fallback_reason is Reason.donation_unsupported
    assert "set_by_processing" in str(loader.donation_error)
    assert model_state(default).differences(model_state(model)) == []
    with httpx.Client(base_url=daemon.url) as http:
        assert http.get("/v1/donations").json() == []


def test_an_engine_whose_key_differs_donates_its_own(
    checkpoints: dict[str, Path], daemon: DaemonProcess
) -> None:
    checkpoint = checkpoints["qwen2"]
    first, _ = _load(checkpoint, "weight_cache", daemon.url)
    second, _ = _load(checkpoint, "weight_cache", daemon.url, max_model_len=128)
    assert first.donated is not None and second.donated is not None
    assert first.donated != second.donated
    keys = [DonationKey(**d["key"]) for d in httpx.get(f"{daemon.url}/v1/donations").json()]
    assert keys[0].differences(keys[1]) == ["max_model_len"]
    first.attachment.close()
    second.attachment.close()


class _Attention(torch.nn.Module):
    """A weight on the model's device and a scale vLLM keeps on the host beside it, as its
    attention layers keep ``_k_scale_cpu``."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(8, 4, device=device), requires_grad=False)
        self._k_scale_cpu = torch.tensor(0.25)


def test_a_tensor_the_donor_keeps_on_the_host_comes_back_to_the_host(
    checkpoints: dict[str, Path], daemon: DaemonProcess
) -> None:
    """On a GPU, vLLM keeps a few tensors on the host (attention scales): the donor copies them
    into its GPU arena with the rest, marked, and an engine binds them back as host copies,
    where a GPU model's forward reads them. On the host nothing is marked."""
    from engine_client.vllm.donated import bind_donated, capture, snapshot

    on_gpu = _Attention("meta")  # the weight elsewhere than the host, as on a GPU
    state, _ = capture(on_gpu, snapshot(on_gpu), torch.device("meta"))
    assert {r.name: r.on_host for r in state.roles} == {"weight": False, "_k_scale_cpu": True}
    donor = _Attention("cpu")
    torch.nn.init.normal_(donor.weight)
    cpu_state, tensors = capture(donor, snapshot(donor), torch.device("cpu"))
    assert not any(r.on_host for r in cpu_state.roles)

    config = ClientConfig.from_env(url=daemon.url)
    model = donate(config, key_for(checkpoints["llama"]), tensors, state)
    expect = Expectations(torch.device("cpu"), kernel=DONATED_KERNEL, supported_schemes=frozenset())
    with attach(model, expect, config=config) as attachment:
        engine = _Attention("meta")
        bind_donated(engine, attachment, torch.device("cpu"))
        arena = attachment.arena.base
        assert arena is not None
        inside = range(arena.data_ptr(), arena.data_ptr() + arena.numel())
        assert engine.weight.data_ptr() in inside
        assert engine._k_scale_cpu.data_ptr() not in inside
        assert engine._k_scale_cpu.device.type == "cpu"
        assert torch.equal(engine.weight, donor.weight)
        assert torch.equal(engine._k_scale_cpu, donor._k_scale_cpu)
