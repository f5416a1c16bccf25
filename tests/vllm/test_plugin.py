"""The ``weight_cache`` load format inside vLLM 0.33: entry point, registry, options, and the
fallback to vLLM's default loader."""

from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness.checkpoint_tools import hub_snapshot
from harness.daemon_process import free_port
from tests.vllm.vllm_model import configs, vllm_world

# How torch reports a custom op that no loaded library registered.
MISSING_OP = re.compile(
    r"'_OpNamespace' '(?P<namespace>\w+)' object has no attribute '(?P<op>\w+)'"
)


@dataclass
class Delegations:
    """Each call of vLLM's DefaultModelLoader.load_model (its load config), and what it raised."""

    configs: list = field(default_factory=list)
    raised: list[BaseException] = field(default_factory=list)


def observe_default_loader(monkeypatch) -> Delegations:
    """Record each call of vLLM's DefaultModelLoader.load_model, then run the real one."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    seen = Delegations()
    real = DefaultModelLoader.load_model

    def observed(self, vllm_config, model_config, prefix=""):
        seen.configs.append(self.load_config)
        try:
            return real(self, vllm_config, model_config, prefix)
        except BaseException as exc:
            seen.raised.append(exc)
            raise

    monkeypatch.setattr(DefaultModelLoader, "load_model", observed)
    return seen


def load_allowing_missing_cpu_ops(loader, vllm_config, model_config, seen: Delegations) -> None:
    """Run ``loader.load_model``. vLLM's CUDA wheel builds its custom ops for CUDA only, so on a
    CPU-only machine vLLM's own (default) load may stop at the first one its CPU platform calls:
    which one depends on the kernels it selects for this host's CPU (``convert_weight_packed``
    for the embedding, ``static_scaled_fp8_quant`` when requantizing, ...). Such a stop is
    accepted only when it came out of vLLM's default loader (so the delegation happened) and
    names a custom op this process really lacks; any other error fails the test. On a GPU the
    load completes."""
    try:
        loader.load_model(vllm_config, model_config)
    except AttributeError as exc:
        missing = MISSING_OP.fullmatch(str(exc))
        if missing is None or not seen.raised or seen.raised[-1] is not exc:
            raise
        import torch

        namespace = getattr(torch.ops, missing["namespace"])
        assert not hasattr(namespace, missing["op"]), f"{missing['op']} exists: a real failure"


def test_entry_point_is_installed() -> None:
    (ep,) = [
        e
        for e in importlib.metadata.entry_points(group="vllm.general_plugins")
        if e.name == "weight_cache"
    ]
    assert ep.value == "engine_client.vllm_plugin:register"


def test_plugins_register_the_load_format() -> None:
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    loader = get_model_loader(
        LoadConfig(load_format="weight_cache", model_loader_extra_config={"url": "http://x:1"})
    )
    assert type(loader).__name__ == "WeightCacheModelLoader"
    assert loader.options.url == "http://x:1" and loader.options.fallback is True
    assert loader.fallback_config.load_format == "auto"
    assert loader.fallback_config.model_loader_extra_config == {}
    # vLLM's own daemon keeps its name
    assert type(get_model_loader(LoadConfig(load_format="ipc_cache"))).__name__ == "IpcModelLoader"


def test_unknown_options_are_refused() -> None:
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    from engine_client.vllm_plugin import register

    register()
    with pytest.raises(ValueError, match="cache_dir"):
        get_model_loader(
            LoadConfig(load_format="weight_cache", model_loader_extra_config={"cache_dir": "/x"})
        )


def test_cli_accepts_the_load_format() -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(
        [
            "--model",
            "m",
            "--load-format",
            "weight_cache",
            "--model-loader-extra-config",
            '{"url": "http://127.0.0.1:8470", "fallback": false}',
        ]
    )
    load_config = EngineArgs.from_cli_args(args).create_load_config()
    assert load_config.load_format == "weight_cache"
    assert load_config.model_loader_extra_config == {
        "url": "http://127.0.0.1:8470",
        "fallback": False,
    }


def test_without_the_daemon_it_delegates_to_vllms_default_loader(
    tiny_fp8: Path, monkeypatch
) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    from engine_client.fallback import FALLBACKS
    from engine_client.vllm_plugin import register

    register()
    delegated = observe_default_loader(monkeypatch)
    url = f"http://127.0.0.1:{free_port()}"
    vllm_config, model_config = configs(tiny_fp8, "weight_cache", {"url": url})
    loader = get_model_loader(vllm_config.load_config)
    before = FALLBACKS["daemon_unavailable"]
    with set_current_vllm_config(vllm_config), vllm_world(port=free_port()):
        load_allowing_missing_cpu_ops(loader, vllm_config, model_config, delegated)
    assert loader.fallback_reason == "daemon_unavailable"
    assert FALLBACKS["daemon_unavailable"] == before + 1
    assert [c.load_format for c in delegated.configs] == ["auto"]
    assert delegated.configs[0].model_loader_extra_config == {}


def test_a_failure_of_vllms_own_load_is_its_own(tiny_fp8: Path, monkeypatch) -> None:
    """After a fallback, an error of vLLM's default load is raised as it is: not chained onto
    the daemon's error (a reader would blame the daemon), and its last line names the
    fallback's reason."""
    import traceback

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    from engine_client.vllm_plugin import register

    def fails(self, vllm_config, model_config, prefix=""):
        raise RuntimeError("vLLM's own load stopped")

    register()
    monkeypatch.setattr(DefaultModelLoader, "load_model", fails)
    url = f"http://127.0.0.1:{free_port()}"
    vllm_config, model_config = configs(tiny_fp8, "weight_cache", {"url": url})
    loader = get_model_loader(vllm_config.load_config)
    with (
        set_current_vllm_config(vllm_config),
        vllm_world(port=free_port()),
        pytest.raises(RuntimeError, match="own load stopped") as raised,
    ):
        loader.load_model(vllm_config, model_config)
    error = raised.value
    assert error.__cause__ is None and error.__context__ is None
    printed = "".join(traceback.format_exception(error))
    assert "DaemonUnavailableError" not in printed
    assert printed.rstrip().splitlines()[-1] == (
        "weight-cache had fallen back to vLLM's default loader (daemon_unavailable); this "
        "error is that loader's own"
    )


def test_fallback_false_raises(tiny_fp8: Path) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    from engine_client.vllm_plugin import register
    from protocol.errors import DaemonUnavailableError

    register()
    url = f"http://127.0.0.1:{free_port()}"
    vllm_config, model_config = configs(tiny_fp8, "weight_cache", {"url": url, "fallback": False})
    loader = get_model_loader(vllm_config.load_config)
    with (
        set_current_vllm_config(vllm_config),
        vllm_world(port=free_port()),
        pytest.raises(DaemonUnavailableError),
    ):
        loader.load_model(vllm_config, model_config)


def test_a_kernel_other_than_cutlass_is_refused_then_falls_back(
    daemon_process, tiny_fp8: Path, monkeypatch
) -> None:
    """On the CPU platform vLLM picks a torch scaled-mm kernel, not CUTLASS: the loader must not
    bind the CUTLASS layout to it, and says so."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    from engine_client.vllm_plugin import register

    register()
    delegated = observe_default_loader(monkeypatch)
    vllm_config, model_config = configs(tiny_fp8, "weight_cache", {"url": daemon_process.url})
    loader = get_model_loader(vllm_config.load_config)
    with set_current_vllm_config(vllm_config), vllm_world(port=free_port()):
        load_allowing_missing_cpu_ops(loader, vllm_config, model_config, delegated)
    assert loader.fallback_reason == "kernel_mismatch"
    assert [c.load_format for c in delegated.configs] == ["auto"]
    # the meta build was undone: vLLM's rotary cache holds no meta tensors for the fallback
    from vllm.model_executor.layers import rotary_embedding

    assert rotary_embedding._ROPE_DICT  # the fallback built its own rotary embeddings
    assert all(r.cos_sin_cache.device.type != "meta" for r in rotary_embedding._ROPE_DICT.values())
    import httpx

    assert httpx.get(f"{daemon_process.url}/v1/leases").json() == []


@pytest.mark.parametrize("cached", [True, False])
def test_a_repo_id_is_found_in_the_local_hub_cache(
    tiny_fp8: Path, tmp_path: Path, monkeypatch, cached: bool
) -> None:
    """vLLM given a Hugging Face repo id reads it from the local cache; the loader finds the
    same snapshot to compare a lease with (it fell back at once with not_local_checkpoint),
    and falls back with that reason only when the repo is not in the cache."""
    from engine_client.vllm.engine_start import local_checkpoint
    from protocol.errors import VerificationError
    from protocol.reasons import Reason

    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "0123abcd"
    if cached:
        assert hub_snapshot(tmp_path / "hub", "org/tiny", tiny_fp8) == snapshot
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    _, model_config = configs(tiny_fp8)
    model_config.model = "org/tiny"  # as `vllm serve org/tiny` names it
    if cached:
        assert local_checkpoint(model_config) == snapshot
    else:
        with pytest.raises(VerificationError) as err:
            local_checkpoint(model_config)
        assert err.value.reason is Reason.not_local_checkpoint
