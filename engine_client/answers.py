"""Reading the daemon's answers: a problem document becomes the typed error the daemon raised
(:func:`protocol.errors.error_from_problem`), a body its schema, and anything else (a proxy's
error page, a body of the wrong shape) :class:`~protocol.errors.BadResponseError`."""

from __future__ import annotations

from typing import TypeVar

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError

from protocol.errors import BadResponseError, error_from_problem
from protocol.reasons import Reason

__all__ = ["TRANSPORT_ERRORS", "parse_answer", "parse_answers", "raise_for_problem"]

T = TypeVar("T", bound=BaseModel)


def raise_for_problem(response: httpx.Response) -> None:
    """A refusal as the typed error it names; an answer that is no problem document of the
    API (another web server's HTML page, a proxy's error) is ``bad_response``, never
    ``internal_error`` with the page pasted in."""
    if response.status_code < 400:
        return
    try:
        body = response.json()
    except ValueError:
        body = None
    if not (isinstance(body, dict) and isinstance(body.get("code"), str) and body["code"]):
        kind = response.headers.get("content-type", "no content type").split(";")[0]
        raise BadResponseError(
            f"HTTP {response.status_code} ({kind}) is not an answer of the weight-cache API: "
            "something else answers at this address",
            reason=Reason.bad_response,
            http_status=response.status_code,
        )
    raise error_from_problem(body, response.status_code)


def parse_answer(model: type[T], content: bytes) -> T:
    """The daemon's answer as ``model``; anything else is the daemon (or whatever answered in
    its place) not speaking the API, raised typed."""
    try:
        return model.model_validate_json(content)
    except ValidationError as exc:
        raise BadResponseError(
            f"the answer is not a valid {model.__name__}: {exc.errors()[0]['msg']}",
            reason=Reason.bad_response,
        ) from exc


def parse_answers(model: type[T], content: bytes) -> list[T]:
    """The daemon's answer as a list of ``model``, as :func:`parse_answer`."""
    try:
        return TypeAdapter(list[model]).validate_json(content)  # type: ignore[valid-type]
    except ValidationError as exc:
        raise BadResponseError(
            f"the answer is not a list of {model.__name__}: {exc.errors()[0]['msg']}",
            reason=Reason.bad_response,
        ) from exc


# Errors of the transport (httpx.InvalidURL is not an HTTPError).
TRANSPORT_ERRORS = (httpx.HTTPError, httpx.InvalidURL)
