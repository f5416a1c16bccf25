"""``weight-cache status``: the inventory as a table, for an operator."""

from __future__ import annotations

import click

from weight_cache_cli.options import client_config, daemon_options


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


@click.command("status")
@daemon_options
def status(url: str | None, uds: str | None, token_file: str | None) -> None:
    """Print devices, models and leases held by a running daemon."""
    from rich.console import Console
    from rich.table import Table

    from engine_client.client import DaemonClient
    from protocol.errors import WeightCacheError
    from weight_cache_cli.parking import parked_engines, print_parked, slot_tickets

    try:
        with DaemonClient(client_config(url, uds, token_file)) as client:
            inv = client.inventory()
            parked, tickets = parked_engines(client), slot_tickets(client)
    except WeightCacheError as exc:
        raise click.ClickException(exc.explain(cli=True)) from exc
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
            f"{_size(d.free_memory) if d.free_memory is not None else '?'} / "
            f"{_size(d.total_memory)}",
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
        "parked",
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
            str(m.parked.count),
            m.quant_algo or "-",
        )
    console.print(models)
    print_parked(parked, tickets)
