"""Asking an OpenAI-compatible server (``vllm serve``, or a proxy in front of engines) for
completions as the proofs do: the prompt as token ids, greedy, a fixed number of tokens, the
answer's token ids returned (``return_token_ids``, vLLM's extension); and a steady stream of such
requests whose every outcome is kept, so a kill in the middle can be accounted for.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

MAX_TOKENS = 16
SERVED_MODEL_NAME = "proof"


def completion_body(prompt: Sequence[int], max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    return {
        "model": SERVED_MODEL_NAME,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
    }


@dataclass(frozen=True)
class Answer:
    """One request: when it was sent and answered (``time.monotonic()``), and its outcome."""

    started: float
    ended: float
    status: int | None
    tokens: list[int] | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.tokens is not None

    @property
    def seconds(self) -> float:
        return self.ended - self.started


def _tokens(payload: object) -> list[int] | None:
    if not isinstance(payload, dict):
        return None
    choices = payload.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    ids = choices[0].get("token_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        return None
    return ids


def complete(client: httpx.Client, prompt: Sequence[int], max_tokens: int = MAX_TOKENS) -> Answer:
    """POST ``/v1/completions`` on ``client``'s base URL; never raises for the server's or the
    network's failures (they are the answer's ``status`` and ``error``)."""
    started = time.monotonic()
    try:
        response = client.post("/v1/completions", json=completion_body(prompt, max_tokens))
    except httpx.HTTPError as exc:
        return Answer(started, time.monotonic(), None, error=f"{type(exc).__name__}: {exc}")
    ended = time.monotonic()
    if response.status_code != 200:
        return Answer(started, ended, response.status_code, error=response.text[:200])
    try:
        tokens = _tokens(response.json())
    except ValueError:
        tokens = None
    if tokens is None:
        return Answer(started, ended, 200, error=f"no token ids: {response.text[:200]}")
    return Answer(started, ended, 200, tokens)


class RequestStream:
    """``workers`` threads, each sending the same completion request one after another (a
    ``pause_s`` apart) until stopped, every answer kept. Nothing is retried here: what a client
    sees is what a proxy and the engines behind it gave."""

    def __init__(
        self,
        base_url: str,
        prompt: Sequence[int],
        *,
        workers: int = 2,
        pause_s: float = 0.05,
        timeout_s: float = 120.0,
        max_tokens: int = MAX_TOKENS,
    ) -> None:
        self.base_url = base_url
        self.prompt = list(prompt)
        self.max_tokens = max_tokens
        self.pause_s = pause_s
        self.timeout_s = timeout_s
        self._answers: list[Answer] = []
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._work, name=f"stream-{i}", daemon=True)
            for i in range(workers)
        ]

    def _work(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=self.timeout_s) as client:
            while not self._stop.is_set():
                answer = complete(client, self.prompt, self.max_tokens)
                with self._changed:
                    self._answers.append(answer)
                    self._changed.notify_all()
                self._stop.wait(self.pause_s)

    def start(self) -> RequestStream:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> list[Answer]:
        """Stop sending, wait for the requests in flight, and return every answer."""
        self._stop.set()
        for thread in self._threads:
            thread.join(self.timeout_s + 5)
        return self.answers()

    def __enter__(self) -> RequestStream:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def answers(self) -> list[Answer]:
        with self._changed:
            return list(self._answers)

    def wait_answered(self, count: int, since: float, timeout: float) -> bool:
        """Wait until ``count`` requests sent at or after ``since`` (a monotonic time) were
        answered successfully; False if ``timeout`` seconds pass first."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while sum(1 for a in self._answers if a.ok and a.started >= since) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(min(left, 0.5))
        return True


@dataclass
class StreamAccount:
    """What a stream of answers shows around an event at ``event`` (a monotonic time): how
    many failed and how, the slowest request in flight during ``window``, the first success
    sent after the event, and answers whose tokens differ from the expected ones."""

    requests: int
    ok: int
    failed: int
    failures: list[str] = field(default_factory=list)
    wrong_tokens: int = 0
    slowest_in_window_s: float | None = None
    first_ok_after_event_s: float | None = None

    @classmethod
    def of(
        cls,
        answers: Sequence[Answer],
        expected: Sequence[int] | None,
        event: float | None = None,
        window: tuple[float, float] | None = None,
    ) -> StreamAccount:
        failed = [a for a in answers if not a.ok]
        account = cls(
            requests=len(answers),
            ok=len(answers) - len(failed),
            failed=len(failed),
            failures=sorted({f"{a.status}: {(a.error or '')[:120]}" for a in failed})[:10],
        )
        if expected is not None:
            account.wrong_tokens = sum(1 for a in answers if a.ok and a.tokens != list(expected))
        if window is not None:
            lo, hi = window
            during = [a.seconds for a in answers if a.started <= hi and a.ended >= lo]
            account.slowest_in_window_s = round(max(during), 3) if during else None
        if event is not None:
            after = [a.ended for a in answers if a.ok and a.started >= event]
            account.first_ok_after_event_s = round(min(after) - event, 3) if after else None
        return account

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)
