"""Attach or read: attach when it can, otherwise read the checkpoint itself with a stated,
counted reason, or raise when fallback is off."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import httpx
import pytest
import torch

from engine_client.checkpoint_read import attach_or_read, read_checkpoint
from engine_client.client import ClientConfig
from engine_client.fallback import FALLBACKS
from engine_client.verify import Expectations
from harness.daemon_process import free_port
from protocol.errors import DaemonUnavailableError

CPU = torch.device("cpu")


def test_attaches_when_the_daemon_has_the_model(daemon_process, tiny_fp8: Path) -> None:
    result = attach_or_read(
        "tiny",
        tiny_fp8,
        Expectations.for_checkpoint(tiny_fp8, CPU),
        config=ClientConfig(url=daemon_process.url),
    )
    assert result.source == "daemon" and result.reason is None
    assert result.attachment is not None and result.attachment.zero_copy()
    result.attachment.close()


def test_falls_back_with_a_reason_when_no_daemon(tiny_fp8: Path, caplog) -> None:
    before = FALLBACKS["daemon_unavailable"]
    config = ClientConfig(url=f"http://127.0.0.1:{free_port()}", retries=0)
    with caplog.at_level(logging.WARNING):
        result = attach_or_read(
            "tiny", tiny_fp8, Expectations.for_checkpoint(tiny_fp8, CPU), config=config
        )
    assert result.source == "disk" and result.reason == "daemon_unavailable"
    assert FALLBACKS["daemon_unavailable"] == before + 1
    assert "daemon_unavailable" in caplog.text
    disk, layers = read_checkpoint(tiny_fp8, CPU)
    assert result.layers == layers and result.tensors.keys() == disk.keys()


def test_verification_failure_is_the_stated_reason(daemon_process, tiny_fp8, tiny_pc) -> None:
    result = attach_or_read(
        "tiny",
        tiny_pc,
        Expectations.for_checkpoint(tiny_pc, CPU),
        config=ClientConfig(url=daemon_process.url),
    )
    assert result.source == "disk" and result.reason == "fingerprint_mismatch"
    assert httpx.get(f"{daemon_process.url}/v1/leases").json() == []


def test_no_fallback_raises(tiny_fp8: Path) -> None:
    config = ClientConfig(url=f"http://127.0.0.1:{free_port()}", retries=0)
    with pytest.raises(DaemonUnavailableError):
        attach_or_read(
            "tiny",
            tiny_fp8,
            Expectations.for_checkpoint(tiny_fp8, CPU),
            config=config,
            fallback=False,
        )


def test_waits_for_a_model_still_loading(tmp_path: Path, tiny_fp8: Path, held_load, caplog) -> None:
    """With ``wait_s``, a 503 model_loading answer is retried until the load is done (the load
    is held open until the engine has been told to wait at least once)."""
    from harness.daemon_process import InProcessDaemon, make_settings

    settings = make_settings(tmp_path, [], allowed_roots=[tiny_fp8.parent])
    with InProcessDaemon(settings) as served:
        config = ClientConfig(url=served.url)
        httpx.post(f"{served.url}/v1/models", json={"path": str(tiny_fp8), "id": "late"})
        without_wait = attach_or_read(
            "late", tiny_fp8, Expectations.for_checkpoint(tiny_fp8, CPU), config=config
        )
        assert without_wait.source == "disk" and without_wait.reason == "model_loading"
        threading.Timer(1.0, held_load.set).start()
        with caplog.at_level(logging.INFO, logger="engine_client.attach"):
            result = attach_or_read(
                "late",
                tiny_fp8,
                Expectations.for_checkpoint(tiny_fp8, CPU),
                config=config,
                wait_s=30,
            )
        assert result.source == "daemon" and result.attachment is not None
        assert "still loading" in caplog.text
        result.attachment.close()
