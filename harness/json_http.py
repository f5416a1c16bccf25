"""A small HTTP server's answers for the stand-ins the tests and proofs run in place of a daemon
or an engine: a status, a JSON (or empty) body, and no access log line per request."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler


class JsonAnswers(BaseHTTPRequestHandler):
    def answer(self, status: int, body: bytes = b"") -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def answer_json(self, status: int, value: object) -> None:
        self.answer(status, json.dumps(value).encode())

    def read_body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("content-length") or 0))

    def log_message(self, format: str, *args: object) -> None:
        pass  # one line per request would flood the logs
