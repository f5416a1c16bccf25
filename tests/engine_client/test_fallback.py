"""Fallback is total: every failure on the way to attached weights is one typed reason, logged
once, counted (in-process and in Prometheus), then an ordinary load; or raised typed."""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client import REGISTRY

from engine_client.arenas import open_arena
from engine_client.checkpoint_read import attach_or_read
from engine_client.client import ClientConfig
from engine_client.fallback import (
    FALLBACKS,
    as_weight_cache_error,
    fall_back_or_raise,
    reason_of,
    typed_failures,
)
from engine_client.verify import Expectations
from harness.daemon_process import DaemonProcess, lease_body
from harness.json_http import JsonAnswers
from protocol.errors import (
    ArenaUnavailableError,
    AttachError,
    BadResponseError,
    CorruptFileError,
    DaemonRestartedError,
    DaemonUnavailableError,
    InvalidRequestError,
    IpcOpenError,
    LayoutMismatchError,
    LeaseExpiredError,
    LeaseNotFoundError,
    ModelFailedError,
    ModelLoadingError,
    ModelNotFoundError,
    UnauthorizedError,
    VerificationError,
    WeightCacheError,
    error_from_problem,
)
from protocol.reasons import Reason
from protocol.schemas.manifest import ArenaDescriptor, ShmHandle
from protocol.schemas.problem import Problem

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (DaemonUnavailableError("x"), Reason.daemon_unavailable),
        (UnauthorizedError("x"), Reason.unauthorized),
        (ModelNotFoundError("x"), Reason.model_not_found),
        (ModelLoadingError("x"), Reason.model_loading),
        (ModelFailedError("x", reason="arena_lost"), Reason.model_failed),
        (LayoutMismatchError("x"), Reason.layout_mismatch),
        (DaemonRestartedError("x"), Reason.daemon_restarted),
        (LeaseExpiredError("x", reason="expired"), Reason.lease_expired),
        (LeaseNotFoundError("x"), Reason.lease_expired),
        (CorruptFileError("x"), Reason.checkpoint_unreadable),
        (InvalidRequestError("x"), Reason.daemon_error),
        (error_from_problem({"code": "from_the_future"}, 418), Reason.daemon_error),
        (VerificationError("x", reason=Reason.kernel_mismatch), Reason.kernel_mismatch),
        (VerificationError("x", reason="nonsense"), Reason.manifest_invalid),
        (BadResponseError("x"), Reason.bad_response),
        (ArenaUnavailableError("x"), Reason.arena_unavailable),
        (IpcOpenError("x"), Reason.ipc_open_failed),
        (AttachError("x", reason=Reason.bind_failed), Reason.bind_failed),
    ],
)
def test_every_error_has_one_reason(error: WeightCacheError, reason: Reason) -> None:
    assert reason_of(error) is reason


def test_any_exception_becomes_typed() -> None:
    typed = ModelNotFoundError("x")
    assert as_weight_cache_error(typed) is typed
    bound = as_weight_cache_error(KeyError("qkv_proj"), Reason.bind_failed)
    assert isinstance(bound, AttachError) and reason_of(bound) is Reason.bind_failed
    assert "KeyError" in bound.detail and "qkv_proj" in bound.detail
    assert reason_of(as_weight_cache_error(RuntimeError("bug"))) is Reason.internal_error
    with pytest.raises(AttachError) as err, typed_failures(Reason.rebuild_failed):
        raise IndexError("out of range")
    assert err.value.reason is Reason.rebuild_failed
    assert isinstance(err.value.__cause__, IndexError)


def test_no_raw_reason_strings_in_the_engine_side() -> None:
    """Reasons are spelled through the enum, never as string literals (the daemon's included)."""
    sources = [
        *(ROOT / "engine_client").glob("*.py"),
        *(ROOT / "protocol" / "errors").glob("*.py"),
        *(ROOT / "service").rglob("*.py"),
    ]
    raw = [
        f"{path.name}: {m.group(0)}"
        for path in sources
        for m in re.finditer(r"reason=[\"'][a-z_]+[\"']", path.read_text())
    ]
    assert raw == []


def _descriptor(path: Path, size: int) -> ArenaDescriptor:
    handle = ShmHandle(path=str(path), size=size, boot_id="b")
    return ArenaDescriptor(index=0, nbytes=size, handle=handle)


def test_an_arena_that_cannot_be_mapped_is_typed(tmp_path: Path) -> None:
    with pytest.raises(ArenaUnavailableError) as err:
        open_arena(_descriptor(tmp_path / "gone", 4096), "b00t.1")
    assert err.value.reason is Reason.arena_unavailable and err.value.extra["file"].endswith("gone")
    short = tmp_path / "short"
    short.write_bytes(b"\0" * 100)
    with pytest.raises(ArenaUnavailableError, match="100 bytes"):
        open_arena(_descriptor(short, 4096), "b00t.1")
    with pytest.raises(ArenaUnavailableError):
        open_arena(_descriptor(tmp_path, 4096), "b00t.1")  # a directory


class AnswerServer(ThreadingHTTPServer):
    """Answers every lease request with one fixed (status, body) and records the requests,
    standing in for a daemon whose answers a test needs to break."""

    def __init__(self, status: int, body: bytes) -> None:
        self.status, self.body = status, body
        self.requests: list[tuple[str, str]] = []
        server = self

        class Handler(JsonAnswers):
            def _record(self, status: int, body: bytes = b"") -> None:
                server.requests.append((self.command, self.path))
                self.read_body()
                self.answer(status, body)

            def do_POST(self) -> None:
                self._record(server.status, server.body)

            def do_DELETE(self) -> None:
                self._record(204)

        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def answer() -> Iterator[type[AnswerServer]]:
    servers: list[AnswerServer] = []

    class Started(AnswerServer):
        def __init__(self, status: int, body: bytes) -> None:
            super().__init__(status, body)
            servers.append(self)
            threading.Thread(target=self.serve_forever, daemon=True).start()

    yield Started
    for server in servers:
        server.shutdown()
        server.server_close()


def prometheus(reason: Reason) -> float:
    value = REGISTRY.get_sample_value("weight_cache_engine_fallbacks_total", {"reason": reason})
    return value or 0.0


def real_grant(daemon: DaemonProcess) -> dict[str, object]:
    """A grant as the daemon wrote it, released at once (only its shape is reused: the arena
    is mapped by its path, the released lease's handle access dropped)."""
    grant = httpx.post(f"{daemon.url}/v1/leases", json=lease_body()).json()
    httpx.delete(f"{daemon.url}/v1/leases/{grant['lease']['id']}")
    assert isinstance(grant, dict)
    grant["arenas"][0]["handle"]["access"] = None
    return grant


def _fall_back(url: str, tiny_fp8: Path, reason: Reason, caplog: pytest.LogCaptureFixture) -> None:
    before, before_prom = FALLBACKS[reason], prometheus(reason)
    with caplog.at_level(logging.WARNING, logger="engine_client"):
        result = attach_or_read(
            "tiny",
            tiny_fp8,
            Expectations.for_checkpoint(tiny_fp8, CPU),
            config=ClientConfig(url=url, cache_layouts=False),
        )
    assert result.source == "disk" and result.reason is reason and result.tensors
    assert FALLBACKS[reason] == before + 1 and prometheus(reason) == before_prom + 1
    logged = [r for r in caplog.records if f"({reason.value})" in r.getMessage()]
    assert len(logged) == 1, caplog.text  # logged once


def test_an_answer_that_is_not_json_falls_back(answer, tiny_fp8: Path, caplog) -> None:
    server = answer(201, b"<html>a proxy's error page</html>")
    _fall_back(server.url, tiny_fp8, Reason.bad_response, caplog)


def test_a_grant_of_the_wrong_shape_falls_back(answer, tiny_fp8: Path, caplog) -> None:
    server = answer(201, json.dumps({"lease": {"id": 1}}).encode())
    _fall_back(server.url, tiny_fp8, Reason.bad_response, caplog)


def test_an_arena_gone_before_the_engine_maps_it_falls_back(
    answer, daemon_process: DaemonProcess, tiny_fp8: Path, tmp_path: Path, caplog
) -> None:
    """A grant naming a file this engine cannot see (another /dev/shm, or removed since) and a
    handle socket it cannot reach (the run directory not shared): the lease is released and the
    engine loads from disk."""
    grant = real_grant(daemon_process)
    handle = grant["arenas"][0]["handle"]  # type: ignore[index]
    handle["path"] = str(tmp_path / "not-here")
    handle["access"] = {"socket": str(tmp_path / "no.sock"), "secret": "s"}
    server = answer(201, json.dumps(grant).encode())
    _fall_back(server.url, tiny_fp8, Reason.arena_unavailable, caplog)
    assert ("DELETE", f"/v1/leases/{grant['lease']['id']}") in server.requests  # type: ignore[index]


def test_views_the_arena_cannot_hold_fall_back(
    answer, daemon_process: DaemonProcess, tiny_fp8: Path, caplog
) -> None:
    """A stride that reaches past a tensor's storage passes the bounds check but cannot be
    rebuilt: ``rebuild_failed``, not an exception out of the engine."""
    grant = real_grant(daemon_process)
    tensor = grant["manifest"]["tensors"][0]  # type: ignore[index]
    tensor["stride"] = [s * 1000 for s in tensor["stride"]]
    server = answer(201, json.dumps(grant).encode())
    _fall_back(server.url, tiny_fp8, Reason.rebuild_failed, caplog)


def test_fallback_off_raises_the_typed_error(answer, tiny_fp8: Path) -> None:
    server = answer(201, b"not json")
    with pytest.raises(BadResponseError):
        attach_or_read(
            "tiny",
            tiny_fp8,
            Expectations.for_checkpoint(tiny_fp8, CPU),
            config=ClientConfig(url=server.url),
            fallback=False,
        )


@pytest.mark.gpu
def test_a_refused_ipc_handle_is_typed() -> None:
    """CUDA refusing a handle (here one no process exported) is ``ipc_open_failed``."""
    import base64

    from protocol.devices import cuda_uuid
    from protocol.schemas.manifest import CudaIpcHandle

    handle = CudaIpcHandle(
        device_uuid=cuda_uuid(0),
        storage_handle=base64.b64encode(bytes(64)).decode(),  # a cudaIpcMemHandle of zeros
        storage_size_bytes=1 << 20,
        storage_offset_bytes=0,
        ref_counter_handle="AAAA",
        ref_counter_offset=0,
        event_handle=None,
        event_sync_required=False,
        tensor_offset=0,
        tensor_size=1 << 20,
    )
    with pytest.raises(IpcOpenError) as err:
        open_arena(ArenaDescriptor(index=0, nbytes=1 << 20, handle=handle), "b00t.1")
    assert err.value.reason is Reason.ipc_open_failed


def test_fall_back_or_raise_with_fallback_counts_and_returns_the_reason(caplog) -> None:
    before = FALLBACKS[Reason.model_loading]
    try:
        raise ModelLoadingError("still loading")
    except ModelLoadingError as exc:
        with caplog.at_level(logging.WARNING, logger="engine_client"):
            reason = fall_back_or_raise(exc, True, "reading from disk")
    assert reason is Reason.model_loading and FALLBACKS[Reason.model_loading] == before + 1
    assert "reading from disk (model_loading): still loading" in caplog.text


def test_fall_back_or_raise_without_fallback_raises_typed() -> None:
    typed = VerificationError("no", reason=Reason.kernel_mismatch)
    with pytest.raises(VerificationError) as err:
        try:
            raise typed
        except VerificationError as exc:
            fall_back_or_raise(exc, False, "unused")
    assert err.value is typed
    with pytest.raises(AttachError) as attach_err:
        try:
            raise KeyError("layers.0")
        except KeyError as exc:
            fall_back_or_raise(exc, False, "unused")
    assert attach_err.value.reason is Reason.internal_error
    assert isinstance(attach_err.value.__cause__, KeyError)


def test_a_reason_member_serialises_as_its_value() -> None:
    """Errors carry ``Reason`` members; on the wire, in logs and as labels they read as the
    values they always were."""
    member = VerificationError("x", reason=Reason.layout_mismatch).problem_fields()
    value = VerificationError("x", reason="layout_mismatch").problem_fields()
    assert json.dumps(member) == json.dumps(value)
    problem = Problem.model_validate(member)
    assert problem.model_dump_json() == Problem.model_validate(value).model_dump_json()
    assert f"{Reason.layout_mismatch}" == "layout_mismatch"
