"""Errors as ``application/problem+json``: every refusal carries a stable ``code``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from protocol.errors import (
    InvalidRequestError,
    MethodNotAllowedError,
    NotFoundError,
    UnauthorizedError,
    WeightCacheError,
)
from protocol.logsafe import get_logger
from protocol.schemas.problem import Problem

log = get_logger(__name__)

PROBLEM_MEDIA_TYPE = "application/problem+json"
REFUSED = "weight_cache.body_refused"  # scope key set once a middleware has answered


def log_refusal(method: str, path: str, error: WeightCacheError) -> None:
    """One line per refused request: status, code and path (escaped by the log formatter), at
    ERROR for the daemon's own faults (500) and INFO for the rest."""
    level = logging.ERROR if error.status >= 500 and error.status != 503 else logging.INFO
    log.log(level, "refused %s %s: %d %s: %s", method, path, error.status, error.code, error.detail)


def problem_response(error: WeightCacheError, **headers: str) -> JSONResponse:
    body = error.problem_fields()
    if "retry_after_s" in error.extra:
        headers["Retry-After"] = str(error.extra["retry_after_s"])
    if isinstance(error, UnauthorizedError):
        headers["WWW-Authenticate"] = 'Bearer realm="weight-cache"'
    return JSONResponse(
        body, status_code=error.status, media_type=PROBLEM_MEDIA_TYPE, headers=headers or None
    )


async def refuse(
    scope: Scope,
    receive: Receive,
    send: Send,
    error: WeightCacheError,
    on_refuse: Callable[[str], None] | None,
) -> None:
    """A middleware's refusal: counted, logged and answered as a problem document; the app's
    own answer, if any, is dropped and not counted (``scope[REFUSED]``)."""
    scope[REFUSED] = True
    if on_refuse is not None:
        on_refuse(error.code)
    log_refusal(scope.get("method", "?"), scope.get("path", "?"), error)
    await problem_response(error)(scope, receive, send)


def _allowed_methods(request: Request) -> list[str]:
    """Every method any route serves at this path (Starlette names only the first route's)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        path_regex = getattr(route, "path_regex", None)
        if path_regex is not None and path_regex.match(request.url.path):
            methods.update(getattr(route, "methods", None) or ())
    return sorted(methods)


def _what_is_wrong(request: Request, exc: RequestValidationError) -> str:
    """The refusal of a request the schema rejects, in words: a body that is not JSON at all
    (where it stops parsing), or sent as something else than JSON, before field errors."""
    errors = exc.errors()
    bad_json = next((e for e in errors if e.get("type") == "json_invalid"), None)
    if bad_json is not None:
        why = (bad_json.get("ctx") or {}).get("error", "not JSON")
        where = bad_json.get("loc", ("body", "?"))[-1]
        return f"the body is not valid JSON: {why} at character {where}"
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    body_errors = [e for e in errors if tuple(e.get("loc", ()))[:1] == ("body",)]
    sent_json = kind == "application/json" or kind.endswith("+json")
    if body_errors and not sent_json:
        said = f"says {kind}" if kind else "has no Content-Type"
        return f"send the body as JSON with 'Content-Type: application/json' (this request {said})"
    return "the request does not match the API schema (see errors)"


def problem_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries documenting problem bodies for ``statuses``."""
    return {
        status: {
            "model": Problem,
            "content": {PROBLEM_MEDIA_TYPE: {}},
            "description": "Problem document; see `code`",
        }
        for status in statuses
    }


def install(app: FastAPI) -> None:
    def count(request: Request, error: WeightCacheError) -> None:
        """Count and log a refusal once (the body limit does both for its own)."""
        if request.scope.get(REFUSED):
            return
        log_refusal(request.method, request.url.path, error)
        daemon = getattr(request.app.state, "daemon", None)
        if daemon is not None:
            daemon.count_refusal(error.code)

    @app.exception_handler(WeightCacheError)
    async def _typed(request: Request, exc: WeightCacheError) -> JSONResponse:
        count(request, exc)
        return problem_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {
                "loc": [str(x) for x in e.get("loc", ())],
                "msg": str(e.get("msg", "")),
                "type": str(e.get("type", "")),
            }
            for e in exc.errors()
        ]
        error = InvalidRequestError(_what_is_wrong(request, exc), errors=errors)
        count(request, error)
        return problem_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """The framework's own refusals (no route raises HTTPException), as typed errors."""
        headers = dict(getattr(exc, "headers", None) or {})
        error: WeightCacheError
        if exc.status_code == 400:  # a body the framework could not even parse
            detail = f"malformed request: {exc.detail}"
            error = InvalidRequestError(
                detail, errors=[{"loc": ["body"], "msg": str(exc.detail), "type": "malformed"}]
            )
        elif exc.status_code == 404:
            error = NotFoundError(str(exc.detail))
        elif exc.status_code == 405:
            error = MethodNotAllowedError(str(exc.detail))
            headers["Allow"] = ", ".join(_allowed_methods(request))
        else:
            log.error("unexpected HTTP %d on %s: %s", exc.status_code, request.url.path, exc)
            error = WeightCacheError(f"HTTP {exc.status_code}: {exc.detail}")
        count(request, error)
        return problem_response(error, **headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        error = WeightCacheError(f"internal error: {type(exc).__name__}")
        count(request, error)
        return problem_response(error)
