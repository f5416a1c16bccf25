"""The part of ``vllm serve``'s HTTP API a warm standby uses: ``/health`` and the sleep
endpoints vLLM 0.33 serves under ``VLLM_SERVER_DEV_MODE=1`` (``POST /sleep?level=``,
``POST /wake_up``, ``GET /is_sleeping``); ``tests/vllm/test_engine_api.py`` fails on the vLLM
version where these routes or their answers change.

Asleep at level 1 an engine started with ``--enable-sleep-mode`` gives its KV cache back to the
GPU and keeps what its graphs point at (vLLM's ``CuMemAllocator`` keeps the virtual addresses),
while the weights it leased from the daemon are not its allocations and stay mapped. vLLM
pauses its scheduler too: a request sent meanwhile waits, so a proxy must keep requests off a
sleeping engine (``GET /is_sleeping``).
"""

from __future__ import annotations

import httpx

from protocol.errors import StandbyEngineError

DEV_MODE_VARIABLE = "VLLM_SERVER_DEV_MODE"  # vLLM serves the sleep endpoints only when set
SLEEP_FLAG = "--enable-sleep-mode"  # without it (or on a CPU) sleeping frees no GPU memory


class EngineApi:
    """One engine's API server at ``url`` (``http://127.0.0.1:8000``)."""

    def __init__(
        self, url: str, timeout_s: float = 120.0, client: httpx.Client | None = None
    ) -> None:
        self.url = url.rstrip("/")
        self._client = client or httpx.Client(base_url=self.url, timeout=timeout_s)

    def close(self) -> None:
        self._client.close()

    def healthy(self) -> bool:
        """Whether the engine answers ``/health`` with 200 (vLLM listens only once it serves)."""
        try:
            return self._client.get("/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def sleep(self, level: int) -> None:
        """Put the engine to sleep once the requests in flight are answered (mode ``wait``: a
        request a proxy sent before it saw the engine was a standby is served, not aborted)."""
        self._post("/sleep", {"level": str(level), "mode": "wait"})

    def wake_up(self) -> None:
        """Wake every part of the engine and resume its scheduler."""
        self._post("/wake_up", {})
        if self.is_sleeping():
            raise StandbyEngineError(f"the engine at {self.url} still sleeps after /wake_up")

    def is_sleeping(self) -> bool:
        answer = self._request("GET", "/is_sleeping", {})
        try:
            value = answer.json()["is_sleeping"]
        except (ValueError, KeyError, TypeError) as exc:
            raise StandbyEngineError(
                f"GET {self.url}/is_sleeping answered {answer.text[:200]!r}"
            ) from exc
        return bool(value)

    def _post(self, path: str, params: dict[str, str]) -> None:
        self._request("POST", path, params)

    def _request(self, method: str, path: str, params: dict[str, str]) -> httpx.Response:
        try:
            answer = self._client.request(method, path, params=params)
        except httpx.HTTPError as exc:
            raise StandbyEngineError(f"{method} {self.url}{path}: {exc}") from exc
        if answer.status_code == 404:
            raise StandbyEngineError(
                f"{method} {self.url}{path}: 404 (the engine serves its sleep endpoints only "
                f"with {DEV_MODE_VARIABLE}=1)"
            )
        if answer.status_code >= 400:
            raise StandbyEngineError(
                f"{method} {self.url}{path}: {answer.status_code} {answer.text[:300]}"
            )
        return answer
