"""A stand-in HTTP upstream for the proxy tests (run as a script): answers ``/health`` and
``POST /v1/completions`` (after a short pause, so requests are in flight when it is killed)
with the port that served them. It stands in for the engine only where the proxy's behaviour is
under test: the engine's own behaviour is tested with vLLM."""

from __future__ import annotations

import sys
import time
from http.server import ThreadingHTTPServer

from harness.json_http import JsonAnswers


class Handler(JsonAnswers):
    def do_GET(self) -> None:
        self.answer_json(200 if self.path == "/health" else 404, {})

    def do_POST(self) -> None:
        self.read_body()
        time.sleep(0.02)
        self.answer_json(200, {"served_by": self.server.server_port})  # type: ignore[attr-defined]


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
    print("ready", flush=True)
    server.serve_forever()
