"""``weight-cache serve``: run the daemon under uvicorn.

It starts fast or fails fast: settings, directories and checkpoints are checked first, then the
socket is bound (a taken port ends it before any load starts), and only then do the startup
models load, beside an API that already answers. Each failure is one line and a non-zero exit.
"""

from __future__ import annotations

import gc
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from protocol.logsafe import get_logger
from weight_cache_cli.listen import bind, stopping_signal_deferred
from weight_cache_cli.log_options import log_options
from weight_cache_cli.settings_options import describe, environment_only, settings_options

if TYPE_CHECKING:  # imported when the command runs: `--help` needs neither torch nor FastAPI
    from service.daemon import Daemon
    from service.settings import DaemonSettings

log = get_logger(__name__)
DEMO_MODEL_ID = "demo"

EXIT_SETTINGS = 2  # a flag, variable, directory or checkpoint is wrong: fix the command
# Any other failure (the port is taken, a startup model failed to load) exits 1, click's status.


class SettingsError(click.ClickException):
    """A bad setting: one line, exit status 2 (no usage text: the line says what to fix)."""

    exit_code = EXIT_SETTINGS


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
        models = None if settings.models is None else list(map(locate_checkpoint, settings.models))
    except ValidationError as exc:
        raise SettingsError(describe(exc)) from exc
    except WeightCacheError as exc:
        raise SettingsError(f"--model: {exc.detail}") from exc
    return settings.model_copy(update={"models": models})


def check_settings(settings: DaemonSettings) -> None:
    """Everything that can be known wrong before binding."""
    from protocol.errors import ShmDirError, WeightCacheError
    from service.memory.devices import resolve_placements
    from service.memory.shm import ArenaDir, group_id
    from service.run_dir import prepare_run_dir

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
    try:
        prepare_run_dir(settings.run_dir, group_id(settings.shm_group))
    except (WeightCacheError, OSError) as exc:
        raise SettingsError(f"--run-dir: {exc}") from exc


def _startup_failure(daemon: Daemon) -> str:
    model, error = daemon.startup_failure or ("?", None)
    what = error.explain() if error is not None else "failed"
    return (
        f"startup model {model!r} failed to load: {what}. Pass --keep-going to serve the "
        "other models anyway"
    )


@click.command("serve", epilog=environment_only())
@settings_options
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
        listener, close_listener = bind(settings)
    except ValueError as exc:
        raise SettingsError(str(exc)) from exc
    with stopping_signal_deferred() as stopped:
        try:
            if settings.models is None:  # none asked for; `--model ''` asks for none
                settings = settings.model_copy(
                    update={
                        "models": [_demo_checkpoint(settings.cache_dir)],
                        "model_id": settings.model_id or DEMO_MODEL_ID,
                    }
                )
            daemon = _run(settings, listener, stopped)
        finally:
            close_listener()  # a socket file goes with the daemon
    if daemon.startup_failure is not None:
        raise click.ClickException(_startup_failure(daemon))
    log.info("%s", what_stays(settings, stopped))


def what_stays(settings: DaemonSettings, stopped: list[int]) -> str:
    """The daemon's last line: why it stopped, and what outlives it (the keeper, with the
    models it holds for the next daemon, and how to stop it)."""
    import signal

    from service.keeper.control import keeper_status
    from service.run_dir import default_run_dir

    why = f"stopped ({signal.Signals(stopped[0]).name})" if stopped else "stopped"
    if settings.keeper == "off":
        return f"{why}; the models' memory is freed with the daemon (--keeper off)"
    held = keeper_status(settings.run_dir)
    if held is None or not held.models:
        return f"{why}; no keeper holds a model"
    who = f"pid {held.pid}" if held.pid > 0 else "in another PID namespace"
    when = (
        f"after {held.idle_timeout_s:g} s without a daemon"
        if held.idle_timeout_s
        else "when it is stopped"
    )
    elsewhere = f" --run-dir {settings.run_dir}" if settings.run_dir != default_run_dir() else ""
    return (
        f"{why}. The keeper ({who}) still holds {', '.join(held.models)} for the next daemon on "
        f"{settings.run_dir}: `weight-cache serve` started again takes it over without loading. "
        f"The keeper lets go {when}, or now with `weight-cache keeper --stop{elsewhere}`"
    )


def _run(settings: DaemonSettings, listener: socket.socket, stopped: list[int]) -> Daemon:
    """Build the daemon and serve until stopped (not at all if ``stopped`` already holds a
    signal: one sent while it started is not lost)."""
    import uvicorn

    from protocol.errors import KeeperUnavailableError
    from service.api.app import create_app
    from service.api.front.config import server_config
    from service.daemon import Daemon

    keep_responsive(settings.load_threads, settings.load_nice)

    def stop() -> None:  # a startup model failed: the server is running by then
        server.should_exit = True

    daemon = Daemon(settings, on_startup_failure=stop)
    try:  # before any load: a keeper's arenas are taken over, not loaded again
        daemon.custody.keeper.connect()
    except KeeperUnavailableError as exc:
        raise click.ClickException(exc.explain(cli=True)) from exc
    app = create_app(settings, daemon)
    # log_config=None and no log_level: uvicorn's loggers keep the handler and level that
    # --log-level and --log-format gave the whole process. The guarded protocol bounds
    # connections, header size and the time to send a request.
    config = server_config(app, settings, log_config=None, log_level=None)
    server = uvicorn.Server(config)
    host, port = listener.getsockname()[:2] if settings.uds is None else ("", 0)
    where = settings.uds or f"http://{f'[{host}]' if ':' in host else host}:{port}"
    log.info("weight-cache daemon listening on %s (device %s)", where, settings.device)
    # The startup heap (torch, FastAPI, pydantic: hundreds of thousands of objects) goes to the
    # permanent generation: a full collection set off by a burst of allocations (a 65,536-entry
    # header, a request flood) then walks only what came since, instead of holding the GIL, and
    # the event loop, for 100 ms and more. vLLM's engine does the same once it is up.
    gc.freeze()
    if stopped:
        log.info("stopped by signal %d before serving", stopped[0])
        return daemon
    server.run(sockets=[listener])
    return daemon
