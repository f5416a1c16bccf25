"""``weight-cache keeper``: hold the daemon's arenas across its restarts, in the foreground (a
container or sidecar; ``serve --keeper auto`` starts one detached instead), or stop the one
that runs (``--stop``)."""

from __future__ import annotations

from pathlib import Path

import click

from protocol.setting import setting_of
from service.env import env_names
from service.keeper.settings import KeeperSettings

_RUN_DIR = env_names("run_dir")[0]
_SHM_GROUP = env_names("shm_group")[0]


_IDLE = setting_of(KeeperSettings.model_fields["idle_timeout"])


@click.command("keeper")
@click.option(
    "--run-dir",
    type=click.Path(path_type=Path),
    envvar=_RUN_DIR,
    help="The daemon's run directory; the keeper listens on <run-dir>/keeper.sock "
    f"[default: as `serve`; env: {_RUN_DIR}].",
)
@click.option(
    "--shm-group",
    envvar=_SHM_GROUP,
    help="Group that may use the run directory (0750), as `serve --shm-group` "
    f"[env: {_SHM_GROUP}].",
)
@click.option(
    "--idle-timeout",
    "--keeper-idle-timeout",
    "idle_timeout",
    type=click.FloatRange(min=0),
    envvar=list(_IDLE.variables),
    default=KeeperSettings.model_fields["idle_timeout"].default,
    help=f"{_IDLE.help} [default: {_IDLE.shown_default}; env: {_IDLE.variable}].",
)
@click.option(
    "--stop",
    is_flag=True,
    help="Stop the keeper that serves on --run-dir (it lets go of every model it holds; "
    "engines that map one keep it) and exit.",
)
def keeper(run_dir: Path | None, shm_group: str | None, idle_timeout: float, stop: bool) -> None:
    """Hold the daemon's arenas (descriptors, shared-memory files), models and leases, so that a
    daemon started again takes them over without reading a checkpoint. SIGTERM lets go of
    everything (engines that map an arena keep it)."""
    from protocol.errors import WeightCacheError
    from service.keeper.server import Keeper
    from service.memory.shm import group_id
    from service.run_dir import KEEPER_SOCKET, default_run_dir

    run_dir = run_dir or default_run_dir()
    if stop:
        _stop(run_dir, run_dir / KEEPER_SOCKET)
        return
    try:
        Keeper(run_dir, idle_timeout, group_id(shm_group)).serve()
    except (WeightCacheError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc


def _stop(run_dir: Path, socket: Path) -> None:
    from service.keeper.control import stop_keeper

    try:
        held = stop_keeper(run_dir)
    except (ProcessLookupError, TimeoutError) as exc:
        raise click.ClickException(str(exc)) from exc
    if held is None:
        click.echo(f"no keeper answers on {socket}")
        return
    models = ", ".join(held.models) or "no model"
    click.echo(f"stopped the keeper (pid {held.pid}) on {socket}; it let go of {models}")
