"""``weight-cache status``: the inventory as a table, for an operator."""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from service.errors import WeightCacheError


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


@click.command("status")
@click.option(
    "--url",
    envvar="WEIGHT_CACHE_URL",
    default="http://127.0.0.1:8470",
    show_default=True,
    help="Daemon URL.",
)
@click.option("--uds", envvar="WEIGHT_CACHE_UDS", help="Daemon Unix socket (instead of --url).")
@click.option(
    "--token-file",
    envvar="WEIGHT_CACHE_TOKEN_FILE",
    type=click.Path(exists=True, dir_okay=False),
    help="Bearer token file.",
)
def status(url: str, uds: str | None, token_file: str | None) -> None:
    """Print devices, models and leases held by a running daemon."""
    from pathlib import Path

    from engine_client.client import ClientConfig, DaemonClient

    token = Path(token_file).read_text(encoding="utf-8").strip() if token_file else None
    config = ClientConfig.from_env(url=url, uds=uds, token=token)
    try:
        with DaemonClient(config) as client:
            inv = client.inventory()
    except WeightCacheError as exc:
        raise click.ClickException(str(exc)) from exc
    console = Console()
    console.print(
        f"weight-cache {inv.version}  boot {inv.boot_id}  "
        f"cache {_size(inv.cache_bytes)}  active leases {inv.active_leases}"
    )
    devices = Table("device", "name", "uuid", "capability", "free / total", title="Devices")
    for d in inv.devices:
        devices.add_row(
            d.kind.value,
            d.name,
            d.uuid or "-",
            d.compute_capability or "-",
            f"{_size(d.free_memory)} / {_size(d.total_memory)}",
        )
    console.print(devices)
    models = Table(
        "model",
        "state",
        "progress",
        "resident",
        "tensors",
        "layers",
        "tp",
        "leases",
        "quant",
        title="Models",
    )
    for m in inv.models:
        p = m.progress
        done = f"{100 * p.bytes_done / p.bytes_total:.0f}%" if p.bytes_total else "-"
        state = m.state.value + (f" ({m.error.code})" if m.error else "")
        models.add_row(
            m.id,
            state,
            done,
            _size(m.bytes_resident),
            str(m.tensors),
            str(m.layers),
            str(m.tp_size),
            str(m.active_leases),
            m.quant_algo or "-",
        )
    console.print(models)
