"""A stand-in HTTP upstream for the proxy tests (run as a script): answers ``/health`` and
``POST /v1/completions`` (after a short pause, so requests are in flight when it is killed)
with the port that served them. It stands in for the engine only where the proxy's behaviour is
under test: the engine's own behaviour is tested with vLLM."""

from __future__ import annotations

import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def _answer(self, status: int, body: dict[str, object]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._answer(200 if self.path == "/health" else 404, {})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        time.sleep(0.02)
        self._answer(200, {"served_by": self.server.server_port})  # type: ignore[attr-defined]

    def log_message(self, *args: object) -> None:
        pass


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
    print("ready", flush=True)
    server.serve_forever()
