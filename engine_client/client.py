"""HTTP clients for the daemon's API, sync and async, over TCP or a Unix socket: one base
builds every call and holds the retry policy and error mapping; the two clients only send.

Every error body is turned back into the typed error the daemon raised
(:func:`protocol.errors.error_from_problem`); a daemon that cannot be reached raises
:class:`~protocol.errors.DaemonUnavailableError`. Requests that are safe to repeat (reads, renew,
release) are retried a bounded number of times on connection errors; a lease grant is not, since a
grant that reached the daemon but whose answer was lost would leak a lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypedDict, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from engine_client.answers import (
    TRANSPORT_ERRORS,
    parse_answer,
    parse_answers,
    raise_for_problem,
)
from engine_client.layout_cache import LAYOUTS, LayoutKey
from protocol.client_settings import ClientSettings, client_setting
from protocol.errors import DaemonUnavailableError, WeightCacheError
from protocol.schemas.health import Health, Readiness
from protocol.schemas.inventory import Inventory
from protocol.schemas.layout import Kernel, WeightFormat
from protocol.schemas.leases import LeaseGrant, LeaseInfo, LeaseRequest
from protocol.schemas.models import ModelInfo
from protocol.tokens import resolve_token

if TYPE_CHECKING:  # typing.Unpack from Python 3.11; annotations only, never at run time
    from typing_extensions import Unpack

DEFAULT_URL = ClientSettings.model_construct().daemon_url()  # the daemon's defaults
DEFAULT_TIMEOUT_S = 10.0  # seconds a request may take
# Set by `weight-cache standby` in the environment of the engine it starts.
STANDBY_GROUP_VARIABLE = client_setting("standby_group").variable
T = TypeVar("T", bound=BaseModel)


@dataclass(frozen=True)
class ClientConfig:
    """Where the daemon is and how to talk to it, as a client has resolved it."""

    url: str = DEFAULT_URL
    uds: str | None = None
    token: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    retries: int = 2
    retry_backoff_s: float = 0.1
    cache_layouts: bool = True  # send known_layout for layouts this process already holds
    handle_socket: str | None = None  # the daemon's handle socket, if not where grants say
    # Set by `weight-cache standby` for the engine it starts: leases are taken under its group.
    standby_group: str | None = None

    @classmethod
    def from_env(cls, token_file: str | Path | None = None, **overrides: Any) -> ClientConfig:
        """The environment (:class:`~protocol.client_settings.ClientSettings`) under the
        ``overrides`` given (None: not given): the daemon's socket, else its URL, else the host
        and port it binds; a ``url`` given explicitly beats an inherited socket. The token
        follows :func:`protocol.tokens.resolve_token`."""
        given = {k: v for k, v in overrides.items() if v is not None}
        try:
            env = ClientSettings()
        except ValidationError as exc:
            raise DaemonUnavailableError(
                f"the environment does not say where the daemon is: {exc}"
            ) from exc
        values: dict[str, Any] = {"url": env.daemon_url()}
        if "url" not in given:
            values["uds"] = env.uds
        values["standby_group"] = env.standby_group
        values.update(given)
        values["token"] = resolve_token(given.get("token"), token_file)
        return cls(**values)

    def _headers(self) -> dict[str, str]:
        headers = {"accept": "application/json"}
        if self.token:
            headers["authorization"] = f"Bearer {self.token}"
        return headers

    def _base_url(self) -> str:
        return "http://weight-cache" if self.uds else self.url.rstrip("/")

    def _verify(self) -> bool:
        # Loading CA certificates costs ~20 ms per client; plain HTTP and Unix sockets need none.
        return self.uds is None and self.url.startswith("https://")


def _unavailable(config: ClientConfig, exc: Exception) -> DaemonUnavailableError:
    where = config.uds or config.url
    return DaemonUnavailableError(f"cannot reach the daemon at {where}: {exc}", url=where)


# Keep every concurrent request's connection alive (httpx keeps 20 by default).
_LIMITS = httpx.Limits(max_connections=256, max_keepalive_connections=256)


class LeaseTerms(TypedDict, total=False):
    """What a lease asks for besides the model; unsaid: rank 0 of 1 on the CUTLASS kernel in
    the default format, for the daemon's default TTL."""

    tp_rank: int
    tp_size: int
    kernel: str
    format: str
    ttl_s: float | None


class _LeaseCall:
    """One lease request: its body (naming the layout this process holds, if any) and how to
    turn the daemon's answer into a grant with its manifest."""

    def __init__(
        self,
        config: ClientConfig,
        model: str,
        tp_rank: int = 0,
        tp_size: int = 1,
        kernel: str = Kernel.cutlass.value,
        format: str = WeightFormat.default.value,
        ttl_s: float | None = None,
    ) -> None:
        self.key: LayoutKey = (config._base_url() + (config.uds or ""), model, tp_rank, tp_size)
        self.named = LAYOUTS.known(self.key) if config.cache_layouts else None
        self.body = LeaseRequest(
            model=model,
            tp_rank=tp_rank,
            tp_size=tp_size,
            kernel=kernel,
            format=format,
            client_pid=os.getpid(),
            ttl_s=ttl_s,
            known_layout=self.named.layout_digest if self.named else None,
            standby_group=config.standby_group,
        ).model_dump(mode="json", exclude_none=True)

    def grant(self, response: httpx.Response) -> LeaseGrant:
        grant = parse_answer(LeaseGrant, response.content)
        return LAYOUTS.complete(self.key, grant, self.named)


_RETRYABLE = (
    httpx.ConnectError,
    httpx.ReadTimeout,
    httpx.RemoteProtocolError,
    httpx.ConnectTimeout,
)
R = TypeVar("R")


@dataclass(frozen=True)
class _Call(Generic[R]):
    """One API call, as data: what to send, whether it may be repeated, which statuses are
    answers rather than problems, and how to read the answer. Sync and async clients only send
    it (as httpx's ``Client`` and ``AsyncClient`` share their request building)."""

    method: str
    path: str
    read: Callable[[httpx.Response], R]
    idempotent: bool = True
    json: Any = None
    answers: tuple[int, ...] = ()  # statuses >= 400 read as answers (/ready's 503)
    timeout_s: float | None = None  # None: the client's; a call whose work grows with its size

    def request_options(self) -> dict[str, Any]:
        """What httpx's ``request`` takes for this call beside its method and path."""
        timeout = httpx.USE_CLIENT_DEFAULT if self.timeout_s is None else self.timeout_s
        return {"json": self.json, "timeout": timeout}


class _BaseClient:
    """What both clients share: the connection settings, the calls of the API, the retry
    policy and the mapping of answers and transport errors to typed results."""

    config: ClientConfig

    def _client_options(self) -> dict[str, Any]:
        return {
            "base_url": self.config._base_url(),
            "headers": self.config._headers(),
            "timeout": self.config.timeout_s,
        }

    def _attempts(self, call: _Call[Any]) -> range:
        """Requests safe to repeat get ``retries`` more attempts; a grant gets one."""
        return range(1 + (self.config.retries if call.idempotent else 0))

    def _backoff(self, call: _Call[Any], attempt: int, exc: Exception) -> float:
        """Seconds to wait before the next attempt after ``exc``, or the typed error to raise
        when the error is not worth retrying or the attempts are spent."""
        if not isinstance(exc, _RETRYABLE) or attempt + 1 >= len(self._attempts(call)):
            raise _unavailable(self.config, exc) from exc
        return self.config.retry_backoff_s * 2.0**attempt

    @staticmethod
    def _answer(call: _Call[R], response: httpx.Response) -> R:
        if response.status_code not in call.answers:
            raise_for_problem(response)
        return call.read(response)

    # --- the API's calls --------------------------------------------------------------------

    @staticmethod
    def _health() -> _Call[Health]:
        return _Call("GET", "/health", lambda r: parse_answer(Health, r.content))

    @staticmethod
    def _ready() -> _Call[Readiness]:
        # A 503 (still loading, or failed) is a normal answer; asked once, never retried.
        read = lambda r: parse_answer(Readiness, r.content)  # noqa: E731
        return _Call("GET", "/ready", read, idempotent=False, answers=(503,))

    @staticmethod
    def _inventory() -> _Call[Inventory]:
        return _Call("GET", "/v1/inventory", lambda r: parse_answer(Inventory, r.content))

    @staticmethod
    def _models() -> _Call[list[ModelInfo]]:
        return _Call("GET", "/v1/models", lambda r: parse_answers(ModelInfo, r.content))

    @staticmethod
    def _model(model_id: str) -> _Call[ModelInfo]:
        return _Call("GET", f"/v1/models/{model_id}", lambda r: parse_answer(ModelInfo, r.content))

    def _lease(self, model: str, **terms: Unpack[LeaseTerms]) -> _Call[LeaseGrant]:
        lease = _LeaseCall(self.config, model, **terms)
        return _Call("POST", "/v1/leases", lease.grant, idempotent=False, json=lease.body)

    @staticmethod
    def _leases() -> _Call[list[LeaseInfo]]:
        return _Call("GET", "/v1/leases", lambda r: parse_answers(LeaseInfo, r.content))

    @staticmethod
    def _renew(lease_id: str, ttl_s: float | None) -> _Call[LeaseInfo]:
        body = {"ttl_s": ttl_s} if ttl_s is not None else None
        read = lambda r: parse_answer(LeaseInfo, r.content)  # noqa: E731
        return _Call("POST", f"/v1/leases/{lease_id}/renew", read, json=body)

    @staticmethod
    def _release(lease_id: str) -> _Call[None]:
        return _Call("DELETE", f"/v1/leases/{lease_id}", lambda r: None)


class DaemonClient(_BaseClient, contextlib.AbstractContextManager["DaemonClient"]):
    """Synchronous client (used by the CLI and by engines at load time)."""

    def __init__(self, config: ClientConfig | None = None) -> None:
        self.config = config or ClientConfig.from_env()
        transport = httpx.HTTPTransport(uds=self.config.uds, verify=self.config._verify())
        self._http = httpx.Client(transport=transport, **self._client_options())

    def close(self) -> None:
        self._http.close()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, call: _Call[R]) -> R:
        for attempt in self._attempts(call):
            try:
                response = self._http.request(call.method, call.path, **call.request_options())
            except TRANSPORT_ERRORS as exc:
                time.sleep(self._backoff(call, attempt, exc))
                continue
            return self._answer(call, response)
        raise AssertionError("unreachable")

    def health(self) -> Health:
        return self._send(self._health())

    def ready(self) -> Readiness:
        """Readiness; a 503 answer (still loading, or failed) is a normal answer here."""
        return self._send(self._ready())

    def inventory(self) -> Inventory:
        return self._send(self._inventory())

    def models(self) -> list[ModelInfo]:
        return self._send(self._models())

    def model(self, model_id: str) -> ModelInfo:
        return self._send(self._model(model_id))

    def lease(self, model: str, **terms: Unpack[LeaseTerms]) -> LeaseGrant:
        """Lease one rank; the returned grant always carries the full manifest."""
        return self._send(self._lease(model, **terms))

    def leases(self) -> list[LeaseInfo]:
        return self._send(self._leases())

    def renew(self, lease_id: str, ttl_s: float | None = None) -> LeaseInfo:
        return self._send(self._renew(lease_id, ttl_s))

    def release(self, lease_id: str) -> None:
        self._send(self._release(lease_id))

    def send(self, call: ApiCall[R]) -> R:
        """A call built by another engine-side module (parking, start-up slots)."""
        return self._send(call)


class AsyncDaemonClient(_BaseClient):
    """The same API for asyncio callers."""

    def __init__(self, config: ClientConfig | None = None) -> None:
        self.config = config or ClientConfig.from_env()
        transport = httpx.AsyncHTTPTransport(
            uds=self.config.uds, verify=self.config._verify(), limits=_LIMITS
        )
        self._http = httpx.AsyncClient(transport=transport, **self._client_options())

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncDaemonClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _send(self, call: _Call[R]) -> R:
        for attempt in self._attempts(call):
            try:
                response = await self._http.request(
                    call.method, call.path, **call.request_options()
                )
            except TRANSPORT_ERRORS as exc:
                await asyncio.sleep(self._backoff(call, attempt, exc))
                continue
            return self._answer(call, response)
        raise AssertionError("unreachable")

    async def health(self) -> Health:
        return await self._send(self._health())

    async def ready(self) -> Readiness:
        """Readiness; a 503 answer (still loading, or failed) is a normal answer here."""
        return await self._send(self._ready())

    async def inventory(self) -> Inventory:
        return await self._send(self._inventory())

    async def models(self) -> list[ModelInfo]:
        return await self._send(self._models())

    async def model(self, model_id: str) -> ModelInfo:
        return await self._send(self._model(model_id))

    async def lease(self, model: str, **terms: Unpack[LeaseTerms]) -> LeaseGrant:
        """Lease one rank; the returned grant always carries the full manifest."""
        return await self._send(self._lease(model, **terms))

    async def leases(self) -> list[LeaseInfo]:
        return await self._send(self._leases())

    async def renew(self, lease_id: str, ttl_s: float | None = None) -> LeaseInfo:
        return await self._send(self._renew(lease_id, ttl_s))

    async def release(self, lease_id: str) -> None:
        await self._send(self._release(lease_id))

    async def send(self, call: ApiCall[R]) -> R:
        """A call built by another engine-side module (parking, start-up slots)."""
        return await self._send(call)


# What other engine-side modules (parking, start-up slots) build their calls with.
ApiCall = _Call

__all__ = ["AsyncDaemonClient", "ClientConfig", "DaemonClient", "WeightCacheError"]
