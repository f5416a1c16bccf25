"""``weight-cache serve``: run the daemon under uvicorn."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import click

from service.settings import DEFAULT_PORT, DaemonSettings

log = logging.getLogger(__name__)
DEMO_MODEL_ID = "demo"


def _demo_checkpoint(cache_dir: Path) -> Path:
    """The built-in demo model (the ``tiny`` FP8 checkpoint), generated once."""
    from service.demo import write_demo_checkpoint

    path = cache_dir / "demo" / "tiny-fp8"
    if not (path / "config.json").is_file():
        log.info("writing the demo checkpoint to %s", path)
        write_demo_checkpoint(path, "fp8", "tiny")
    return path


def keep_responsive(load_threads: int | None) -> None:
    """Loads run in a worker thread beside the event loop. Leave the loop a core (torch's
    intra-op threads do the processing) and hand the GIL over more often than the default 5 ms,
    so /health and leases answer promptly during a cold load."""
    import os
    import sys

    import torch

    cores = os.cpu_count() or 1
    torch.set_num_threads(load_threads or max(1, cores - 1))
    sys.setswitchinterval(0.001)


def build_settings(**flags: Any) -> DaemonSettings:
    """Environment first, flags given on the command line over it, the demo model if none."""
    given = {k: v for k, v in flags.items() if v not in (None, ())}
    settings = DaemonSettings(**given)
    if not settings.models:
        settings = settings.model_copy(
            update={
                "models": [_demo_checkpoint(settings.cache_dir)],
                "model_id": settings.model_id or DEMO_MODEL_ID,
            }
        )
    return settings


@click.command("serve")
@click.option(
    "--model",
    "models",
    multiple=True,
    type=click.Path(path_type=Path),
    help="Checkpoint to load at start (repeatable). Default: the built-in demo model.",
)
@click.option("--model-id", help="Id of the first --model (default: its directory name).")
@click.option("--host", help=f"Address to bind [default: 127.0.0.1; port {DEFAULT_PORT}].")
@click.option("--port", type=int, help=f"TCP port [default: {DEFAULT_PORT}].")
@click.option("--uds", type=click.Path(path_type=Path), help="Serve on a Unix socket instead.")
@click.option("--device", help="auto, cpu, cuda (rank r on GPU r) or cuda:N [default: auto].")
@click.option("--tp-size", type=int, help="Tensor-parallel size of the --model loads.")
@click.option(
    "--token-file",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="File holding the bearer token every route but /health and /ready needs.",
)
@click.option(
    "--allowed-root",
    "allowed_roots",
    multiple=True,
    type=click.Path(path_type=Path),
    help="POST /v1/models may load checkpoints below this directory (repeatable).",
)
@click.option("--shm-dir", type=click.Path(path_type=Path), help="Shared-memory arena dir.")
@click.option("--memory-budget-bytes", type=int, help="Most bytes the cache may hold.")
@click.option(
    "--shm-group",
    help="Group that may map CPU arenas (directory 0750, files 0640) [default: owner only].",
)
@click.option(
    "--scrub-interval",
    "scrub_interval_s",
    type=float,
    help="Re-check resident arenas against their checksums every N seconds [default: 0, off].",
)
@click.option("--max-leases", type=int, help="Most active leases in all [default: 4096].")
@click.option(
    "--max-leases-per-client", type=int, help="Most active leases of one client PID [default: 256]."
)
def serve(**flags: Any) -> None:
    """Run the daemon: load the models, serve health, inventory and leases.

    Every option can also be set as WEIGHT_CACHE_<OPTION> (e.g. WEIGHT_CACHE_PORT); a flag on
    the command line wins.
    """
    import uvicorn

    from service.api.app import create_app
    from service.api.server import server_config
    from service.memory.devices import resolve_placements

    try:
        settings = build_settings(**flags)
        settings.check_exposure()
        settings.startup_models()
        resolve_placements(settings.device, settings.tp_size)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    keep_responsive(settings.load_threads)
    app = create_app(settings)
    where = str(settings.uds) if settings.uds else f"http://{settings.host}:{settings.port}"
    log.info("weight-cache daemon on %s (device %s)", where, settings.device)
    uvicorn.Server(server_config(app, settings)).run()
