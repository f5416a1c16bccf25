"""A small HTTP server that answers the two routes the restart proof uses of ``vllm serve``
(``GET /health``, ``POST /v1/completions`` with ``return_token_ids``), with token ids computed
from the prompt, so the proof's processes, proxy, request streams and accounting run on a machine
without a GPU. Under ``VLLM_SERVER_DEV_MODE=1`` it also answers vLLM's sleep endpoints
(``POST /sleep``, ``POST /wake_up``, ``GET /is_sleeping``) as ``vllm serve`` does, and counts the
completions it was asked for while asleep (``GET /stats``): a proxy must send none. With
``--attach`` it first leases the model from the daemon as an engine does (the
project's client: a real lease, kept alive while it serves); with ``--park`` it parks with the
daemon before that, listening on no port until released. With ``--attach`` and ``--donated`` (a
checkpoint the daemon does not process) it does what ``--load-format weight_cache`` does there:
it attaches to the daemon's donated model of the checkpoint's key, else it donates the
checkpoint's tensors (read from its files: the daemon really holds them) and leases its own
donation, and says which in the loader's words (or that it served its own load, and why). It
stands for no part of vLLM: tests of the proof's own code use it.

usage: python -m tests.gpu.token_server --port P [--delay-s S]
       [--attach DAEMON_URL --checkpoint DIR (--model ID [--park] | --donated)]
"""

from __future__ import annotations

import argparse
import json
import os
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
    port = 0
    dev_mode = False  # VLLM_SERVER_DEV_MODE: the sleep endpoints are served
    asleep = False
    served_asleep = 0  # completions asked for while asleep

    def do_GET(self) -> None:
        if self.path == "/health":
            self.answer_json(200, {})
        elif self.path == "/stats":
            self.answer_json(200, {"served_asleep": Handler.served_asleep})
        elif self.path == "/is_sleeping" and self.dev_mode:
            self.answer_json(200, {"is_sleeping": Handler.asleep})
        else:
            self.answer_json(404, {"error": "not found"})

    def do_POST(self) -> None:
        request = json.loads(self.read_body() or b"{}")
        path = self.path.split("?", 1)[0]
        if path in ("/sleep", "/wake_up") and self.dev_mode:
            Handler.asleep = path == "/sleep"
            print(f"{'asleep' if Handler.asleep else 'awake'}", flush=True)
            self.answer_json(200, {"status": "sleeping" if Handler.asleep else "awake"})
            return
        if Handler.asleep:
            Handler.served_asleep += 1
        if self.path != "/v1/completions" or not isinstance(request.get("prompt"), list):
            self.answer_json(400, {"error": "expected /v1/completions with token ids"})
            return
        time.sleep(self.delay_s)  # the time a generation takes
        tokens = tokens_for(request["prompt"], int(request.get("max_tokens", 16)))
        choices = [{"index": 0, "text": "", "token_ids": tokens}]
        self.answer_json(200, {"choices": choices, "served_by": Handler.port})


def attach(url: str, checkpoint: Path, model: str) -> object:
    """Lease ``model`` as an engine does (no fallback); what is returned keeps the lease."""
    import torch

    from engine_client.checkpoint_read import attach_or_read
    from engine_client.client import ClientConfig
    from engine_client.verify import Expectations

    expect = Expectations.for_checkpoint(checkpoint, torch.device("cpu"))
    config = ClientConfig.from_env(url=url)  # a standby's group comes from the environment
    weights = attach_or_read(model, checkpoint, expect, config=config, fallback=False)
    print(f"attached {len(weights.tensors)} tensors of {model}", flush=True)
    return weights


def attach_or_donate(url: str, checkpoint: Path) -> object:
    """Attach to the donated model of ``checkpoint``'s key, else donate its tensors, as the
    loader does on a checkpoint the daemon does not process; what is returned keeps the lease
    (None: a refused donation, served on its own weights as the loader does)."""
    import torch
    from safetensors.torch import load_file

    from engine_client.attach import attach as lease
    from engine_client.client import ClientConfig
    from engine_client.donations import ATTACHED_LOG, DONATED_LOG, donate, find_donation
    from engine_client.fallback import FALLBACK_LOG, OWN_LOAD, reason_of
    from engine_client.verify import Expectations
    from harness.donating import key_for, state_of
    from protocol.errors import VerificationError, WeightCacheError
    from protocol.reasons import Reason
    from protocol.schemas.donated import DONATED_KERNEL

    config = ClientConfig.from_env(url=url)
    key = key_for(checkpoint)
    expect = Expectations(torch.device("cpu"), kernel=DONATED_KERNEL, supported_schemes=frozenset())
    try:
        found = find_donation(config, key)
        if found.model is not None:
            held = lease(found.model, expect, config=config)
            print(ATTACHED_LOG % (found.model, len(held.tensors)), flush=True)
            return held
        if found.pending:
            raise VerificationError(
                "another engine is donating this rank right now", reason=Reason.donation_refused
            )
        tensors: dict[str, torch.Tensor] = {}
        for path in sorted(checkpoint.glob("*.safetensors")):
            tensors.update(load_file(path))
        try:
            model = donate(config, key, tensors, state_of(tensors))
        except VerificationError:
            raise
        except WeightCacheError as exc:  # as the loader names a refusal
            raise VerificationError(
                f"the daemon refused the donation: {exc}", reason=Reason.donation_refused
            ) from exc
        held = lease(model, expect, config=config)
        print(DONATED_LOG % (model, len(held.tensors)), flush=True)
        return held
    except WeightCacheError as exc:
        print(FALLBACK_LOG % (OWN_LOAD, reason_of(exc), exc.detail), flush=True)
        return None


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--delay-s", type=float, default=0.01)
    p.add_argument("--attach", metavar="DAEMON_URL")
    p.add_argument("--checkpoint", type=Path)
    p.add_argument("--model")
    p.add_argument("--park", action="store_true")
    p.add_argument("--donated", action="store_true", help="a checkpoint engines donate")
    args = p.parse_args()
    if args.park:
        from tests.gpu.parking import park_and_wait

        print("parking", flush=True)
        state = park_and_wait(args.attach, args.model, timeout_s=600)
        print(f"park ended: {state}", flush=True)
        if state != "released":
            return 1
    held = None
    if args.attach and args.donated:
        held = attach_or_donate(args.attach, args.checkpoint)
    elif args.attach:
        held = attach(args.attach, args.checkpoint, args.model)
    Handler.delay_s = args.delay_s
    Handler.port = args.port
    Handler.dev_mode = os.environ.get("VLLM_SERVER_DEV_MODE") == "1"
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(f"token server listening on {args.port}", flush=True)
    server.serve_forever()
    del held
    return 0


if __name__ == "__main__":
    sys.exit(main())
