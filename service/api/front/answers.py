"""The answers the front writes itself, before or instead of the app: problem documents."""

from __future__ import annotations

import http
import json

from protocol.errors import WeightCacheError
from service.api.problems import PROBLEM_MEDIA_TYPE


def problem_bytes(error: WeightCacheError) -> bytes:
    """A complete HTTP/1.1 response carrying ``error``, closing the connection."""
    body = json.dumps(error.problem_fields()).encode()
    head = (
        f"HTTP/1.1 {error.status} {http.HTTPStatus(error.status).phrase}\r\n"
        f"content-type: {PROBLEM_MEDIA_TYPE}\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body
