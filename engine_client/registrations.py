"""The calls of the two resources an engine registers with and then long-polls, parked engines
(``/v1/parking``) and start-up slot tickets (``/v1/startup-slots``): register (``POST``), ask
with ``wait_s`` (``GET``), withdraw (``DELETE``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import httpx
from pydantic import BaseModel

from engine_client.answers import parse_answer, parse_answers
from engine_client.client import ApiCall

T = TypeVar("T", bound=BaseModel)


@dataclass(frozen=True)
class Registrations(Generic[T]):
    path: str  # the collection: /v1/parking, /v1/startup-slots
    answer: type[T]  # what the daemon answers for one registration

    def register(self, request: BaseModel) -> ApiCall[T]:
        """A new registration (never retried: a second POST would register twice)."""
        body = request.model_dump(mode="json")
        return ApiCall("POST", self.path, self._read, idempotent=False, json=body)

    def ask(self, registration_id: str, wait_s: float) -> ApiCall[T]:
        """The registration now, or once its state changes within ``wait_s``."""
        return ApiCall("GET", f"{self.path}/{registration_id}?wait_s={wait_s:.3f}", self._read)

    def listed(self, method: str = "GET", suffix: str = "") -> ApiCall[list[T]]:
        """A list of registrations: the collection (``GET``), or those an action under it
        answers with (``POST /v1/parking/{id}/release``: ``suffix`` ``/{id}/release``; releasing
        or cancelling twice answers as once, so these are retried as reads are)."""
        read = lambda r: parse_answers(self.answer, r.content)  # noqa: E731
        return ApiCall(method, self.path + suffix, read)

    def withdraw(self, registration_id: str) -> ApiCall[None]:
        return ApiCall("DELETE", f"{self.path}/{registration_id}", lambda r: None)

    def _read(self, answer: httpx.Response) -> T:
        return parse_answer(self.answer, answer.content)
