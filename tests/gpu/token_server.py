"""A small HTTP server that answers the two routes the restart proof uses of ``vllm serve``
(``GET /health``, ``POST /v1/completions`` with ``return_token_ids``), with token ids computed
from the prompt, so the proof's processes, proxy, request streams and accounting run on a machine
without a GPU. With ``--attach`` it first leases the model from the daemon as an engine does (the
project's client: a real lease, kept alive while it serves); with ``--park`` it parks with the
daemon before that, listening on no port until released. It stands for no part of vLLM: tests of
the proof's own code use it.

usage: python -m tests.gpu.token_server --port P [--delay-s S]
       [--attach DAEMON_URL --checkpoint DIR --model ID [--park]]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

from harness.json_http import JsonAnswers


def tokens_for(prompt: list[int], count: int) -> list[int]:
    """The same ids for the same prompt, from any server."""
    seed = sum(prompt) * 31 + len(prompt)
    return [(seed + 7919 * i) % 32000 for i in range(count)]


class Handler(JsonAnswers):
    protocol_version = "HTTP/1.1"
    delay_s = 0.0

    def do_GET(self) -> None:
        if self.path == "/health":
            self.answer_json(200, {})
        else:
            self.answer_json(404, {"error": "not found"})

    def do_POST(self) -> None:
        request = json.loads(self.read_body() or b"{}")
        if self.path != "/v1/completions" or not isinstance(request.get("prompt"), list):
            self.answer_json(400, {"error": "expected /v1/completions with token ids"})
            return
        time.sleep(self.delay_s)  # the time a generation takes
        tokens = tokens_for(request["prompt"], int(request.get("max_tokens", 16)))
        self.answer_json(200, {"choices": [{"index": 0, "text": "", "token_ids": tokens}]})


def attach(url: str, checkpoint: Path, model: str) -> object:
    """Lease ``model`` as an engine does (no fallback); what is returned keeps the lease."""
    import torch

    from engine_client.checkpoint_read import attach_or_read
    from engine_client.client import ClientConfig
    from engine_client.verify import Expectations

    expect = Expectations.for_checkpoint(checkpoint, torch.device("cpu"))
    weights = attach_or_read(
        model, checkpoint, expect, config=ClientConfig(url=url), fallback=False
    )
    print(f"attached {len(weights.tensors)} tensors of {model}", flush=True)
    return weights


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--delay-s", type=float, default=0.01)
    p.add_argument("--attach", metavar="DAEMON_URL")
    p.add_argument("--checkpoint", type=Path)
    p.add_argument("--model")
    p.add_argument("--park", action="store_true")
    args = p.parse_args()
    if args.park:
        from tests.gpu.parking import park_and_wait

        print("parking", flush=True)
        state = park_and_wait(args.attach, args.model, timeout_s=600)
        print(f"park ended: {state}", flush=True)
        if state != "released":
            return 1
    held = attach(args.attach, args.checkpoint, args.model) if args.attach else None
    Handler.delay_s = args.delay_s
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(f"token server listening on {args.port}", flush=True)
    server.serve_forever()
    del held
    return 0


if __name__ == "__main__":
    sys.exit(main())
