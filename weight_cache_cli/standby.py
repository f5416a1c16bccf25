"""``weight-cache standby -- vllm serve ...``: run an engine as a warm standby
(:mod:`engine_client.standby`): it starts all the way, sleeps while another engine serves its
model, and wakes when that one ends or an operator releases it (``weight-cache parking``)."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Sequence
from types import FrameType

import click

from protocol.logsafe import get_logger
from protocol.schemas.tensor_parallel import MAX_TP_SIZE
from weight_cache_cli.options import client_config, daemon_options

log = get_logger(__name__)

STOP_GRACE_S = 30.0
EXIT_CANCELLED = 3  # an operator cancelled the standby: its engine was stopped


def url_of_command(command: Sequence[str]) -> str:
    """Where the command's API server listens: its ``--host``/``--port`` (vLLM's defaults: all
    addresses, 8000), reached on loopback when it binds every address."""
    host, port = "127.0.0.1", "8000"
    for i, word in enumerate(command):
        for flag in ("--host", "--port"):
            value = None
            if word == flag and i + 1 < len(command):
                value = command[i + 1]
            elif word.startswith(flag + "="):
                value = word.split("=", 1)[1]
            if value is None:
                continue
            if flag == "--port":
                port = value
            elif value not in ("", "0.0.0.0", "::"):
                host = f"[{value}]" if ":" in value else value
    return f"http://{host}:{port}"


def _die_with_parent() -> None:
    """In the engine's process before it runs: end it (SIGTERM) if this standby dies, so a
    standby's engine never outlives the process that registered it."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)


def _stop(child: subprocess.Popen[bytes]) -> int:
    if child.poll() is None:
        child.terminate()
        try:
            return child.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            child.kill()
    return child.wait()


@click.command(
    "standby",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@daemon_options
@click.option(
    "--engine-url",
    help="The engine's API server [default: from the command's --host and --port, else "
    "http://127.0.0.1:8000].",
)
@click.option(
    "--model",
    help="The daemon's model to wait for, where the engine holds no lease to tell it (it fell "
    "back to its own weights) [default: its lease's model].",
)
@click.option(
    "--tp-size",
    type=click.IntRange(1, MAX_TP_SIZE),
    default=1,
    show_default=True,
    help="With --model: the engine's TP size.",
)
@click.option(
    "--group",
    help="The id this standby registers under and its engine's leases carry [default: a new one].",
)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def standby(
    url: str | None,
    uds: str | None,
    token_file: str | None,
    engine_url: str | None,
    model: str | None,
    tp_size: int,
    group: str | None,
    command: tuple[str, ...],
) -> None:
    """Run COMMAND (`vllm serve CKPT --load-format weight_cache --enable-sleep-mode ...`) as a
    warm standby.

    \b
    The engine starts all the way (attach, compile, CUDA graphs, KV cache), then, while another
    engine serves the same model, sleeps (its KV cache given back; vLLM's
    --enable-sleep-mode, on a GPU) until the daemon releases it: when the serving engine ends,
    or on `weight-cache parking release ID`. It then wakes and serves; with
    no engine serving the model it serves at once. Put a proxy in front that sends nothing to
    a sleeping engine (docker/Caddyfile asks GET /is_sleeping). Start the same command again
    for the engine that ended: it becomes the next standby. `weight-cache parking cancel ID`
    stops a standby's engine. Exits with the engine's code (3 when cancelled).
    """
    from engine_client.client import STANDBY_GROUP_VARIABLE
    from engine_client.engine_api import DEV_MODE_VARIABLE, SLEEP_FLAG
    from engine_client.standby import Engine, Outcome, StandbyOptions, run_standby
    from protocol.errors import WeightCacheError
    from protocol.processes import process_tree

    group = group or f"standby-{secrets.token_hex(6)}"
    if SLEEP_FLAG not in command:
        log.warning(
            "weight-cache standby: the command has no %s: asleep, the engine keeps its KV cache "
            "(a GPU engine needs the flag to give its memory back)",
            SLEEP_FLAG,
        )
    env = dict(os.environ, **{DEV_MODE_VARIABLE: "1", STANDBY_GROUP_VARIABLE: group})
    child = subprocess.Popen(list(command), env=env, preexec_fn=_die_with_parent)  # noqa: PLW1509

    def forward(signum: int, frame: FrameType | None) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    options = StandbyOptions(
        engine_url=engine_url or url_of_command(command), group=group, model=model, tp_size=tp_size
    )
    engine = Engine(alive=lambda: child.poll() is None, pids=lambda: process_tree(child.pid))
    try:
        outcome = run_standby(client_config(url, uds, token_file), options, engine)
    except WeightCacheError as exc:
        log.error("weight-cache standby: %s: stopping the engine", exc.explain(cli=True))
        _stop(child)
        sys.exit(1)
    if outcome is Outcome.cancelled:
        _stop(child)
        sys.exit(EXIT_CANCELLED)
    sys.exit(child.wait())
