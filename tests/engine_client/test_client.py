"""The HTTP client: typed errors from problem documents, Unix sockets, tokens, and retries only
where repeating a request is safe (checked against a real flaky server)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from engine_client.answers import parse_answer
from engine_client.client import ApiCall, AsyncDaemonClient, ClientConfig, DaemonClient
from engine_client.donations import commit_call
from harness.daemon_process import free_port, start_daemon
from harness.waiting import wait_for
from protocol.checksum import checking_s
from protocol.errors import (
    DaemonUnavailableError,
    LayoutMismatchError,
    ModelNotFoundError,
    UnauthorizedError,
    VerificationError,
)
from protocol.schemas.donated import DonatedState
from protocol.schemas.donations import DonationCommit
from protocol.schemas.health import Health
from protocol.schemas.manifest import TensorEntry


class FlakyServer(threading.Thread):
    """Drops the first ``drops`` connections, then answers /health like the daemon, after
    ``delay_s``."""

    BODY = b'{"status":"ok","boot_id":"b","version":"0","protocol_version":1,"uptime_s":1.0}'

    def __init__(self, drops: int, delay_s: float = 0.0) -> None:
        super().__init__(daemon=True)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.drops = drops
        self.delay_s = delay_s
        self.connections = 0

    def run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.recv(65536)
                if self.connections <= self.drops:
                    continue  # close without answering
                time.sleep(self.delay_s)
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: "
                    + str(len(self.BODY)).encode()
                    + b"\r\nconnection: close\r\n\r\n"
                    + self.BODY
                )


def test_idempotent_reads_are_retried() -> None:
    server = FlakyServer(drops=2)
    server.start()
    config = ClientConfig(url=f"http://127.0.0.1:{server.port}", retries=2, retry_backoff_s=0.01)
    with DaemonClient(config) as client:
        assert client.health().status == "ok"
    assert server.connections == 3
    server.sock.close()


def test_a_lease_grant_is_never_retried() -> None:
    server = FlakyServer(drops=5)
    server.start()
    config = ClientConfig(url=f"http://127.0.0.1:{server.port}", retries=3, retry_backoff_s=0.01)
    with DaemonClient(config) as client, pytest.raises(DaemonUnavailableError):
        client.lease("tiny")
    assert server.connections == 1
    server.sock.close()


def _health_within(timeout_s: float) -> ApiCall[Health]:
    read = lambda r: parse_answer(Health, r.content)  # noqa: E731
    return ApiCall("GET", "/health", read, idempotent=False, timeout_s=timeout_s)


async def test_a_call_may_wait_longer_than_the_client_s_timeout() -> None:
    """A call that names its own timeout (a donation's commit, checked byte by byte) is waited
    for that long; every other call still gives up after the client's."""
    server = FlakyServer(drops=0, delay_s=0.6)
    server.start()
    url = f"http://127.0.0.1:{server.port}"
    config = ClientConfig(url=url, timeout_s=0.2, retries=0)
    with DaemonClient(config) as client:
        with pytest.raises(DaemonUnavailableError, match="timed out"):
            client.health()
        assert client.send(_health_within(10.0)).status == "ok"
    async with AsyncDaemonClient(config) as aclient:
        with pytest.raises(DaemonUnavailableError):
            await aclient.health()
        assert (await aclient.send(_health_within(10.0))).status == "ok"
    server.sock.close()


def test_a_commit_waits_for_its_checksums() -> None:
    """The commit's deadline grows with the bytes the daemon checks: 16 GiB at the slowest
    checking rate is over a minute, far beyond a client's 10 s."""
    entry = TensorEntry(
        name="w",
        arena=0,
        offset=0,
        nbytes=16 << 30,
        dtype="bfloat16",
        shape=[8 << 30],
        stride=[1],
        checksum="0" * 16,
    )
    commit = DonationCommit(
        secret="s" * 32, tensors=[entry], state=DonatedState(roles=[], attributes={})
    )
    call = commit_call("donated-x", commit, 10.0)
    assert call.timeout_s is not None and call.timeout_s == 10.0 + checking_s(16 << 30) > 60


def test_unreachable_daemon() -> None:
    config = ClientConfig(url=f"http://127.0.0.1:{free_port()}", retries=1, retry_backoff_s=0.01)
    with (
        DaemonClient(config) as client,
        pytest.raises(DaemonUnavailableError, match="cannot reach"),
    ):
        client.health()


def test_typed_errors_and_unix_socket_with_token(tmp_path: Path, tiny_fp8: Path) -> None:
    sock, token = tmp_path / "d.sock", tmp_path / "token"
    token.write_text("tok-123\n")
    token.chmod(0o600)
    daemon = start_daemon(
        tmp_path, [tiny_fp8], "--model-id", "tiny", "--token-file", str(token), uds=sock
    )
    try:
        good = ClientConfig(uds=str(sock), token="tok-123")
        with DaemonClient(good) as client:
            assert client.inventory().models[0].id == "tiny"
            with pytest.raises(ModelNotFoundError):
                client.lease("ghost")
            with pytest.raises(LayoutMismatchError) as err:
                client.lease("tiny", kernel="marlin")
            assert err.value.extra["mismatches"]["kernel"]["served"] == "cutlass"
            grant = client.lease("tiny", ttl_s=5)
            assert client.renew(grant.lease.id).renewals == 1
            client.release(grant.lease.id)
            assert client.leases() == []
        with (
            DaemonClient(ClientConfig(uds=str(sock), token="wrong")) as client,
            pytest.raises(UnauthorizedError),
        ):
            client.inventory()
    finally:
        daemon.stop()


async def test_async_client(daemon_process) -> None:
    async with AsyncDaemonClient(ClientConfig(url=daemon_process.url)) as client:
        assert (await client.health()).status == "ok"
        grant = await client.lease("tiny", ttl_s=5)
        assert (await client.renew(grant.lease.id, ttl_s=9)).ttl_s == 9
        await client.release(grant.lease.id)
        assert (await client.inventory()).active_leases == 0
        with pytest.raises(ModelNotFoundError):
            await client.lease("ghost")


async def test_async_client_has_every_call_of_the_sync_one(daemon_process) -> None:
    public = {n for n in dir(DaemonClient) if not n.startswith("_")} - {"close"}
    assert public <= {n for n in dir(AsyncDaemonClient) if not n.startswith("_")}
    async with AsyncDaemonClient(ClientConfig(url=daemon_process.url)) as client:
        assert (await client.ready()).ready
        assert [m.id for m in await client.models()] == ["tiny"]
        assert (await client.model("tiny")).state.value == "ready"
        grant = await client.lease("tiny", ttl_s=5)
        assert [lease.id for lease in await client.leases()] == [grant.lease.id]
        await client.release(grant.lease.id)
        with pytest.raises(ModelNotFoundError):
            await client.model("ghost")


async def test_async_reads_are_retried_and_grants_are_not() -> None:
    """The retry policy is the base's: the async client follows it as the sync one does."""
    server = FlakyServer(drops=2)
    server.start()
    config = ClientConfig(url=f"http://127.0.0.1:{server.port}", retries=2, retry_backoff_s=0.01)
    async with AsyncDaemonClient(config) as client:
        assert (await client.health()).status == "ok"
    assert server.connections == 3
    server.drops = 10
    async with AsyncDaemonClient(config) as client:
        with pytest.raises(DaemonUnavailableError):
            await client.lease("tiny")
    assert server.connections == 4
    server.sock.close()


def test_layouts_are_fetched_once_per_process(daemon_process, monkeypatch) -> None:
    from engine_client.layout_cache import LAYOUTS

    slim: list[bool] = []
    real_complete = LAYOUTS.complete

    def observed(key, grant, named):  # records whether the daemon sent the layout, completes it
        slim.append(grant.manifest is None)
        return real_complete(key, grant, named)

    monkeypatch.setattr(LAYOUTS, "complete", observed)
    config = ClientConfig(url=daemon_process.url)
    with DaemonClient(config) as client:
        first = client.lease("tiny", ttl_s=5)
        key = (f"{daemon_process.url}", "tiny", 0, 1)
        assert LAYOUTS.known(key) == first.manifest
        second = client.lease("tiny", ttl_s=5)
    assert slim == [False, True]
    assert second.full_manifest().tensors == first.full_manifest().tensors
    assert second.full_manifest().layers == first.full_manifest().layers
    assert second.manifest is first.manifest  # this process's copy, not a second download
    with DaemonClient(ClientConfig(url=daemon_process.url, cache_layouts=False)) as client:
        assert client.lease("tiny", ttl_s=5).manifest is not None


def test_a_layout_evicted_mid_lease_still_completes_the_grant(daemon_process, monkeypatch) -> None:
    """The client named a layout, and its cache dropped it before the answer came: the request
    kept the manifest it named, so the grant is complete and one lease is held, not two."""
    from engine_client.layout_cache import LAYOUTS

    config = ClientConfig(url=daemon_process.url)
    with DaemonClient(config) as client:
        first = client.lease("tiny", ttl_s=30)
        client.release(first.lease.id)
        real_known = LAYOUTS.known

        def known_then_evicted(key):
            named = real_known(key)
            LAYOUTS._manifests.clear()
            return named

        monkeypatch.setattr(LAYOUTS, "known", known_then_evicted)
        grant = client.lease("tiny", ttl_s=30)
        assert grant.full_manifest() == first.full_manifest()
        assert [lease.id for lease in client.leases()] == [grant.lease.id]


def test_a_grant_without_the_named_layout_is_refused(daemon_process) -> None:
    """A daemon that leaves out a layout the request did not name breaks the protocol: the
    grant is refused rather than completed with the wrong manifest."""
    from engine_client.layout_cache import LAYOUTS, LayoutCache

    config = ClientConfig(url=daemon_process.url, cache_layouts=False)
    with DaemonClient(config) as client:
        grant = client.lease("tiny", ttl_s=30)
        client.release(grant.lease.id)
    slim = grant.model_copy(update={"manifest": None})
    key = (daemon_process.url, "tiny", 0, 1)
    for named in (None, grant.full_manifest().model_copy(update={"layout_digest": "0" * 32})):
        with pytest.raises(VerificationError) as err:
            LayoutCache().complete(key, slim, named)
        assert err.value.reason == "manifest_invalid"
    assert LAYOUTS.complete(key, slim, grant.full_manifest()).manifest is grant.manifest


def test_ready_reports_a_failed_model_without_raising(
    tmp_path: Path, tiny_fp8: Path, copy_of
) -> None:
    """/ready answers 503 while a startup model is loading: that is an answer, not an error, and
    the client returns it, as it returns the failed models a --keep-going daemon lists."""
    broken = copy_of(tiny_fp8)
    (broken / "config.json").write_text("{}")
    daemon = start_daemon(
        tmp_path, [tiny_fp8], "--model-id", "tiny", "--model", str(broken), "--keep-going",
        wait_ready=False,
    )  # fmt: skip
    try:
        with DaemonClient(ClientConfig(url=daemon.url)) as client:
            wait_for(lambda: client.ready().failed)
            readiness = client.ready()
            assert list(readiness.failed) == [broken.name]
            assert "invalid_config" in readiness.failed[broken.name]
            wait_for(lambda: client.ready().models["tiny"].value == "ready")
            assert client.ready().ready is True  # with --keep-going a failure does not block
    finally:
        daemon.stop()
    with (
        DaemonClient(ClientConfig(url=daemon.url, retries=0)) as client,
        pytest.raises(DaemonUnavailableError),
    ):
        client.ready()


@pytest.mark.parametrize(
    ("environ", "url"),
    [
        ({}, "http://127.0.0.1:8470"),
        ({"WEIGHT_CACHE_PORT": "9001"}, "http://127.0.0.1:9001"),
        ({"WEIGHT_CACHE_HOST": "0.0.0.0", "WEIGHT_CACHE_PORT": "9"}, "http://127.0.0.1:9"),
        ({"WEIGHT_CACHE_HOST": "::1"}, "http://[::1]:8470"),
        ({"WEIGHT_CACHE_URL": "http://h:1", "WEIGHT_CACHE_PORT": "9"}, "http://h:1"),
    ],
)
def test_clients_find_the_daemon_from_its_variables(
    monkeypatch, environ: dict[str, str], url: str
) -> None:
    for name in ("URL", "HOST", "PORT", "UDS"):
        monkeypatch.delenv(f"WEIGHT_CACHE_{name}", raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert ClientConfig.from_env().url == url


def test_a_flag_beats_the_daemon_s_socket(monkeypatch) -> None:
    monkeypatch.setenv("WEIGHT_CACHE_PORT", "9002")
    monkeypatch.setenv("WEIGHT_CACHE_UDS", "/run/wc.sock")
    config = ClientConfig.from_env()
    assert config.url == "http://127.0.0.1:9002" and config.uds == "/run/wc.sock"
    explicit = ClientConfig.from_env(url="http://127.0.0.1:1")
    assert explicit.url == "http://127.0.0.1:1" and explicit.uds is None  # a flag beats the env
