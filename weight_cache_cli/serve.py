"""``weight-cache serve``: run the daemon under uvicorn.

It starts fast or fails fast: settings, directories and checkpoints are checked first, then the
socket is bound (a taken port ends it before any load starts), and only then do the startup
models load, beside an API that already answers. Each failure is one line and a non-zero exit.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from protocol.version import DEFAULT_PORT
from service.env import env_names
from weight_cache_cli.listen import bind, stopping_signal_deferred
from weight_cache_cli.log_options import log_options

if TYPE_CHECKING:  # imported when the command runs: `--help` needs no pydantic
    from pydantic import ValidationError

    from service.daemon import Daemon
    from service.settings import DaemonSettings

log = logging.getLogger(__name__)
DEMO_MODEL_ID = "demo"
F = TypeVar("F", bound=Callable[..., Any])

EXIT_SETTINGS = 2  # a flag, variable, directory or checkpoint is wrong: fix the command
EXIT_FAILED = 1  # the port is taken, or a startup model failed to load


class SettingsError(click.ClickException):
    """A bad setting: one line, exit status 2 (no usage text: the line says what to fix)."""

    exit_code = EXIT_SETTINGS


def _env(field: str) -> str:
    return " or ".join(env_names(field))


def _demo_checkpoint(cache_dir: Path) -> Path:
    """The built-in demo model (the ``tiny`` FP8 checkpoint), generated once."""
    from service.demo import write_demo_checkpoint

    path = cache_dir / "demo" / "tiny-fp8"
    if not (path / "config.json").is_file():
        log.info("writing the demo checkpoint to %s", path)
        write_demo_checkpoint(path, "fp8", "tiny")
    return path


def keep_responsive(load_threads: int | None, load_nice: int = 0) -> None:
    """Loads run in a worker thread beside the event loop. Leave the loop a core (torch's
    intra-op threads do the processing), run the loading threads at a lower CPU priority (the
    kernel runs a request the moment it arrives, not when a load's time slice ends) and hand
    the GIL over more often than the default 5 ms, so /health and leases answer promptly during
    a cold load."""
    import sys

    import torch

    from modelopt_fp8.processing.pool import set_loading_nice

    cores = os.cpu_count() or 1
    torch.set_num_threads(load_threads or max(1, cores - 1))
    set_loading_nice(load_nice)
    sys.setswitchinterval(0.001)


def _flag_of(field: str) -> str:
    flags = {
        "models": "--model",
        "allowed_roots": "--allowed-root",
        "tp_size": "--tensor-parallel-size",
        "memory_budget_bytes": "--memory-budget",
        "max_body_bytes": "--max-body-size",
        "default_ttl_s": "--default-ttl",
        "max_ttl_s": "--max-ttl",
        "reaper_interval_s": "--reaper-interval",
        "token": "",
    }
    return flags.get(field, "--" + field.replace("_", "-"))


def describe(exc: ValidationError) -> str:
    """A settings error as one line naming the flag and variable to fix."""
    from service.settings import DaemonSettings

    by_env = {n: f for f in DaemonSettings.model_fields for n in env_names(f)}
    parts = []
    for error in exc.errors():
        loc = str(error["loc"][0]) if error["loc"] else ""
        field = by_env.get(loc.upper(), loc)
        if field in DaemonSettings.model_fields:
            names = " / ".join(n for n in (_flag_of(field), _env(field)) if n)
        else:
            names = loc or "settings"
        message = str(error["msg"]).removeprefix("Value error, ")
        parts.append(f"{names}: {message}" if loc else message)
    return "; ".join(parts)


def build_settings(**flags: Any) -> DaemonSettings:
    """Environment first, flags given on the command line over it; checkpoints located (a repo
    id through the local Hugging Face cache) and made absolute. Raises :class:`SettingsError`."""
    from pydantic import ValidationError

    from modelopt_fp8.checkpoint.locate import locate_checkpoint
    from protocol.errors import WeightCacheError
    from service.settings import DaemonSettings

    given = {k: v for k, v in flags.items() if v not in (None, ())}
    try:
        settings = DaemonSettings(**given)
        models = [locate_checkpoint(m) for m in settings.models]
    except ValidationError as exc:
        raise SettingsError(describe(exc)) from exc
    except WeightCacheError as exc:
        raise SettingsError(f"--model: {exc.detail}") from exc
    return settings.model_copy(update={"models": models})


def check_settings(settings: DaemonSettings) -> None:
    """Everything that can be known wrong before binding."""
    from protocol.errors import ShmDirError
    from service.memory.devices import resolve_placements
    from service.memory.shm import ArenaDir

    try:
        settings.check_exposure()
        settings.check_directories()
        settings.startup_models()
        resolve_placements(settings.device, settings.tp_size)
        ArenaDir.prepare(settings.shm_dir, settings.shm_group).close()  # ours, or refused
    except ValueError as exc:
        raise SettingsError(str(exc)) from exc
    except ShmDirError as exc:
        raise SettingsError(f"--shm-dir: {exc.explain(cli=True)}") from exc


def _startup_failure(daemon: Daemon) -> str:
    model, error = daemon.startup_failure or ("?", None)
    what = error.explain() if error is not None else "failed"
    return (
        f"startup model {model!r} failed to load: {what}. Pass --keep-going to serve the "
        "other models anyway"
    )


def _settings_options(command: F) -> F:
    """One option per setting, each naming its environment variable in its help."""
    options = [
        click.option(
            "--model",
            "models",
            multiple=True,
            help="Checkpoint directory, or a Hugging Face repo id already in the local HF cache "
            "(HF_HOME / HF_HUB_CACHE), to load at start (repeatable; the variable takes a "
            f"':'-separated list). Default: the built-in demo model. [env: {_env('models')}]",
        ),
        click.option(
            "--model-id",
            help=f"Id of the first --model [default: its directory name; env: {_env('model_id')}]",
        ),
        click.option("--host", help=f"Address to bind [default: 127.0.0.1; env: {_env('host')}]."),
        click.option(
            "--port", type=int, help=f"TCP port [default: {DEFAULT_PORT}; env: {_env('port')}]."
        ),
        click.option(
            "--uds",
            type=click.Path(path_type=Path),
            help=f"Serve on this Unix socket instead of TCP [env: {_env('uds')}].",
        ),
        click.option(
            "--device",
            help="auto, cpu, cuda (rank r on GPU r) or cuda:N "
            f"[default: auto; env: {_env('device')}].",
        ),
        click.option(
            "--tensor-parallel-size",
            "--tp-size",
            "tp_size",
            type=int,
            help=f"Tensor-parallel size of the --model loads [default: 1; env: {_env('tp_size')}].",
        ),
        click.option(
            "--token-file",
            type=click.Path(path_type=Path, exists=True, dir_okay=False),
            help="File holding the bearer token every route but /health and /ready needs "
            f"[env: {_env('token_file')}; or the token itself in {_env('token')}; the file wins].",
        ),
        click.option(
            "--allowed-root",
            "allowed_roots",
            multiple=True,
            type=click.Path(path_type=Path),
            help="POST /v1/models may load checkpoints below this directory (repeatable; "
            f"':'-separated in the variable) [env: {_env('allowed_roots')}].",
        ),
        click.option(
            "--shm-dir",
            type=click.Path(path_type=Path),
            help=f"Shared-memory arena directory [default: /dev/shm; env: {_env('shm_dir')}].",
        ),
        click.option(
            "--cache-dir",
            type=click.Path(path_type=Path),
            help="Where the demo checkpoint is written [default: ~/.cache/weight-cache; "
            f"env: {_env('cache_dir')}].",
        ),
        click.option(
            "--memory-budget",
            "--memory-budget-bytes",
            "memory_budget_bytes",
            help="Most bytes the cache may hold: 40GiB, 512MB (10^6 bytes) or a byte count "
            f"[default: unbounded; env: {_env('memory_budget_bytes')}].",
        ),
        click.option(
            "--max-body-size",
            "max_body_bytes",
            help=f"Largest request body [default: 64KiB; env: {_env('max_body_bytes')}].",
        ),
        click.option(
            "--default-ttl",
            "default_ttl_s",
            type=float,
            help=f"Lease TTL in seconds when a request names none [default: 60; "
            f"env: {_env('default_ttl_s')}].",
        ),
        click.option(
            "--max-ttl",
            "max_ttl_s",
            type=float,
            help=f"Longest lease TTL in seconds [default: 3600; env: {_env('max_ttl_s')}].",
        ),
        click.option(
            "--reaper-interval",
            "reaper_interval_s",
            type=float,
            help="Seconds between sweeps for expired leases and dead clients [default: 1; "
            f"env: {_env('reaper_interval_s')}].",
        ),
        click.option(
            "--load-threads",
            type=int,
            help=f"Threads that process a load [default: cores - 1; env: {_env('load_threads')}].",
        ),
        click.option(
            "--load-nice",
            type=click.IntRange(0, 19),
            help="Niceness the loading threads add to the daemon's, so requests run first on a "
            f"busy machine (0: same priority) [default: 10; env: {_env('load_nice')}].",
        ),
        click.option(
            "--shm-group",
            help="Group that may map CPU arenas (directory 0750, files 0640) [default: owner "
            f"only; env: {_env('shm_group')}].",
        ),
        click.option(
            "--scrub-interval",
            "scrub_interval_s",
            type=float,
            help="Re-check resident arenas against their checksums every N seconds [default: 0, "
            f"off; env: {_env('scrub_interval_s')}].",
        ),
        click.option(
            "--max-leases",
            type=int,
            help=f"Most active leases in all [default: 4096; env: {_env('max_leases')}].",
        ),
        click.option(
            "--max-leases-per-client",
            type=int,
            help="Most active leases of one client PID [default: 256; "
            f"env: {_env('max_leases_per_client')}].",
        ),
        click.option(
            "--max-leases-per-uid",
            type=int,
            help="Most active leases of one user, so one user cannot take the others' room "
            f"[default: 1024; env: {_env('max_leases_per_uid')}].",
        ),
        click.option(
            "--max-models",
            type=int,
            help="Most models registered at once, failed ones included [default: 64; "
            f"env: {_env('max_models')}].",
        ),
        click.option(
            "--max-concurrent-loads",
            type=int,
            help="Most loads running at once; POST /v1/models beyond is refused with 429 "
            f"[default: 4; env: {_env('max_concurrent_loads')}].",
        ),
        click.option(
            "--max-connections",
            type=int,
            help="Most open HTTP connections; more are answered 503 [default: 256; "
            f"env: {_env('max_connections')}].",
        ),
        click.option(
            "--max-header-bytes",
            type=int,
            help="Largest request line and headers of one request [default: 32768; "
            f"env: {_env('max_header_bytes')}].",
        ),
        click.option(
            "--request-timeout",
            "request_timeout_s",
            type=float,
            help="Seconds a client has to send a whole request [default: 10; "
            f"env: {_env('request_timeout_s')}].",
        ),
        click.option(
            "--follow-symlinks/--no-follow-symlinks",
            default=None,
            help="Let API loads name symlinked checkpoints and files whose targets stay below an "
            f"allowed root [default: follow; env: {_env('follow_symlinks')}].",
        ),
        click.option(
            "--keep-going/--no-keep-going",
            default=None,
            help="Keep serving when a startup model fails to load, and report ready once every "
            "startup model is ready or failed [default: exit with status 1; "
            f"env: {_env('keep_going')}].",
        ),
        click.option(
            "--socket-group",
            help="Group that may use the --uds socket (mode 0660) [default: the daemon's user "
            f"only, 0600; env: {_env('socket_group')}].",
        ),
        click.option(
            "--trust-local-users/--no-trust-local-users",
            default=None,
            help="Without a token, serve every local user over loopback TCP [default: only the "
            "daemon's user and root; others use the Unix socket or the token; "
            f"env: {_env('trust_local_users')}].",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


@click.command("serve")
@_settings_options
@log_options
def serve(**flags: Any) -> None:
    """Run the daemon: bind, load the models, serve health, inventory and leases.

    Every option is also an environment variable (listed with each option); a flag on the
    command line wins. Exit status: 2 for a bad setting, directory or checkpoint path; 1 when
    the address is taken or a startup model fails to load (see --keep-going).
    """
    settings = build_settings(**flags)
    check_settings(settings)
    try:
        bound = bind(settings)
    except ValueError as exc:
        raise SettingsError(str(exc)) from exc
    listener = bound.sock if not isinstance(bound, socket.socket) else bound
    with stopping_signal_deferred():
        try:
            if not settings.models:
                settings = settings.model_copy(
                    update={
                        "models": [_demo_checkpoint(settings.cache_dir)],
                        "model_id": settings.model_id or DEMO_MODEL_ID,
                    }
                )
            daemon = _run(settings, listener)
        finally:
            listener.close()
            if not isinstance(bound, socket.socket):
                bound.remove()  # the socket file goes with the daemon
    if daemon.startup_failure is not None:
        raise click.ClickException(_startup_failure(daemon))


def _run(settings: DaemonSettings, listener: socket.socket) -> Daemon:
    import uvicorn

    from service.api.app import create_app
    from service.api.server import server_config
    from service.daemon import Daemon

    keep_responsive(settings.load_threads, settings.load_nice)
    daemon = Daemon(settings)
    app = create_app(settings, daemon)
    # log_config=None and no log_level: uvicorn's loggers keep the handler and level that
    # --log-level and --log-format gave the whole process. The guarded protocol bounds
    # connections, header size and the time to send a request.
    config = server_config(app, settings, log_config=None, log_level=None)
    server = uvicorn.Server(config)

    def stop() -> None:
        server.should_exit = True

    daemon.on_startup_failure(stop)
    host, port = listener.getsockname()[:2] if settings.uds is None else ("", 0)
    where = settings.uds or f"http://{f'[{host}]' if ':' in host else host}:{port}"
    log.info("weight-cache daemon listening on %s (device %s)", where, settings.device)
    # The startup heap (torch, FastAPI, pydantic: hundreds of thousands of objects) goes to the
    # permanent generation: a full collection set off by a burst of allocations (a 65,536-entry
    # header, a request flood) then walks only what came since, instead of holding the GIL, and
    # the event loop, for 100 ms and more. vLLM's engine does the same once it is up.
    gc.freeze()
    server.run(sockets=[listener])
    return daemon
