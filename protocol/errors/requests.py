"""Requests the API refuses as such: malformed, too large, too slow, unauthenticated, or for a
route or path that is not there."""

from __future__ import annotations

from typing import Any

from protocol.client_settings import client_setting
from protocol.errors.base import WeightCacheError

_TOKEN, _TOKEN_FILE = map(client_setting, ("token", "token_file"))


class InvalidRequestError(WeightCacheError):
    code = "invalid_request"
    status = 422
    title = "Invalid request"
    hint = "fix the request; `errors` lists the fields"

    @classmethod
    def of_field(cls, field: str, detail: str, kind: str, **extra: Any) -> InvalidRequestError:
        """The refusal of one body field, with its ``errors`` entry as the schema's are."""
        return cls(detail, errors=[{"loc": ["body", field], "msg": detail, "type": kind}], **extra)


class PayloadTooLargeError(InvalidRequestError):
    code = "payload_too_large"
    status = 413
    title = "Request body too large"
    hint = "send a smaller body (the daemon's limit is --max-body-size)"


class HeadersTooLargeError(InvalidRequestError):
    code = "headers_too_large"
    status = 431
    title = "Request line and headers too large"
    hint = "send smaller headers"


class RequestTimeoutError(InvalidRequestError):
    code = "request_timeout"
    status = 408
    title = "Request not received in time"
    hint = "send the whole request within --request-timeout seconds"


class ChunksTooSmallError(InvalidRequestError):
    """A chunked body whose chunks carry too little to pay for their framing."""

    code = "chunks_too_small"
    status = 400
    title = "Body sent in chunks too small"
    hint = "send the body with Content-Length, or in chunks of at least 256 bytes"


class MalformedRequestError(InvalidRequestError):
    """Bytes that do not parse as HTTP/1.1 at all."""

    code = "malformed_request"
    status = 400
    title = "Malformed HTTP request"
    hint = "speak HTTP/1.1 to the daemon"


class UnauthorizedError(WeightCacheError):
    code = "unauthorized"
    status = 401
    title = "Missing or wrong bearer token"
    hint = "send `Authorization: Bearer <token>` with the daemon's token"
    cli_hint = f"pass {_TOKEN_FILE.flag} FILE, or set {_TOKEN_FILE.variable} or {_TOKEN.variable}"


class PathNotAllowedError(WeightCacheError):
    code = "path_not_allowed"
    status = 403
    title = "Path outside the allowed roots"
    hint = "move the checkpoint below an allowed root, or start the daemon with --allowed-root DIR"


class NotFoundError(WeightCacheError):
    code = "not_found"
    status = 404
    title = "Not found"
    hint = "see openapi.json for the routes"


class MethodNotAllowedError(WeightCacheError):
    code = "method_not_allowed"
    status = 405
    title = "Method not allowed on this path"
    hint = "see openapi.json for the methods each route takes (`Allow`)"


class TooManyConnectionsError(WeightCacheError):
    code = "too_many_connections"
    status = 503
    title = "Too many open connections"
    hint = "retry; close idle connections (--max-connections raises the cap)"


class TooManyOpenRequestsError(WeightCacheError):
    """One caller (a user, or the token's holders) has its share of requests in the daemon's
    hands already: long-polls and requests still arriving included."""

    code = "too_many_open_requests"
    status = 429
    title = "Too many requests in progress for this caller"
    hint = (
        "wait for your requests in progress (long-polls included) to be answered "
        "(--max-requests-per-caller raises the cap)"
    )
