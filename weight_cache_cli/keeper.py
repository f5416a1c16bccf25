"""``weight-cache keeper``: hold the daemon's arenas across its restarts, in the foreground (a
container or sidecar; ``serve --keeper auto`` starts one detached instead)."""

from __future__ import annotations

from pathlib import Path

import click

from service.env import env_names


@click.command("keeper")
@click.option(
    "--run-dir",
    type=click.Path(path_type=Path),
    envvar=env_names("run_dir")[0],
    show_envvar=True,
    help="The daemon's run directory; the keeper listens on <run-dir>/keeper.sock "
    "[default: as `serve`].",
)
@click.option(
    "--shm-group",
    envvar=env_names("shm_group")[0],
    show_envvar=True,
    help="Group that may use the run directory (0750), as `serve --shm-group`.",
)
@click.option(
    "--idle-timeout",
    type=float,
    default=600.0,
    show_default=True,
    help="Seconds without a daemon attached after which the keeper lets go of everything "
    "and exits (0: never).",
)
def keeper(run_dir: Path | None, shm_group: str | None, idle_timeout: float) -> None:
    """Hold the daemon's arenas (descriptors, shared-memory files), models and leases, so that a
    daemon started again takes them over without reading a checkpoint. SIGTERM lets go of
    everything (engines that map an arena keep it)."""
    from protocol.errors import WeightCacheError
    from service.keeper.server import Keeper
    from service.memory.shm import group_id
    from service.run_dir import default_run_dir

    try:
        Keeper(run_dir or default_run_dir(), idle_timeout, group_id(shm_group)).serve()
    except (WeightCacheError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
