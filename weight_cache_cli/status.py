"""``weight-cache status``: the inventory as tables an 80-column terminal shows whole, for an
operator (``--json``: the same as one object, for a script)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import click

from weight_cache_cli.options import client_config, daemon_options

if TYPE_CHECKING:
    from protocol.schemas.inventory import Inventory, KeeperInfo


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def keeper_line(keeper: KeeperInfo | None) -> str:
    """Who holds the arenas across the daemon's restarts, in one line."""
    if keeper is None:
        return "keeper: not reported by this daemon"
    if keeper.mode == "off":
        return "keeper: off (the models' memory goes with the daemon)"
    pid = f"pid {keeper.pid}" if keeper.pid else "pid not visible"
    origin = ", started by the daemon" if keeper.started_by_daemon else ""
    state = "attached" if keeper.attached else "NOT attached"
    return f"keeper: {keeper.mode}, {pid}{origin}, {state}, {keeper.socket}"


def print_inventory(inv: Inventory) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"weight-cache {inv.version}  boot {inv.boot_id}  "
        f"cache {_size(inv.cache_bytes)}  active leases {inv.active_leases}"
    )
    console.print(keeper_line(inv.keeper), soft_wrap=True, markup=False, highlight=False)
    devices = Table("device", "name", "cap.", "free / total", title="Devices")
    for d in inv.devices:
        devices.add_row(
            d.kind.value,
            d.name,
            d.compute_capability or "-",
            f"{_size(d.free_memory) if d.free_memory is not None else '?'} / "
            f"{_size(d.total_memory)}",
        )
    console.print(devices)
    for d in inv.devices:
        if d.uuid:
            console.print(
                f"{d.kind.value} uuid: {d.uuid}", soft_wrap=True, markup=False, highlight=False
            )
    models = Table(
        "model", "state", "loaded", "resident", "tp", "leases", "parked", "quant", title="Models"
    )
    models.columns[0].overflow = "fold"  # an id is shown whole: commands take it
    for m in inv.models:
        p = m.progress
        done = f"{100 * p.bytes_done / p.bytes_total:.0f}%" if p.bytes_total else "-"
        models.add_row(
            m.id,
            m.state.value,
            done,
            _size(m.bytes_resident),
            str(m.tp_size),
            str(m.active_leases),
            str(m.parked.count),
            m.quant_algo or "-",
        )
    console.print(models)
    for m in inv.models:  # below the table, whole: a reason is what an operator acts on
        if m.error is not None:
            console.print(
                f"{m.id} failed: [{m.error.code}] {m.error.detail}",
                soft_wrap=True,
                markup=False,
                highlight=False,
            )


@click.command("status")
@daemon_options
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON object: inventory, parked, slots."
)
def status(url: str | None, uds: str | None, token_file: str | None, as_json: bool) -> None:
    """Print the devices, models, leases and keeper of a running daemon, and its parked
    engines and start-up slots."""
    from engine_client.client import DaemonClient
    from protocol.errors import WeightCacheError
    from weight_cache_cli.parking import parked_engines, print_parked, slot_tickets

    try:
        with DaemonClient(client_config(url, uds, token_file)) as client:
            inv = client.inventory()
            parked, tickets = parked_engines(client), slot_tickets(client)
    except WeightCacheError as exc:
        raise click.ClickException(exc.explain(cli=True)) from exc
    if as_json:
        report = {
            "inventory": inv.model_dump(mode="json"),
            "parked": [p.model_dump(mode="json") for p in parked],
            "startup_slots": [t.model_dump(mode="json") for t in tickets],
        }
        click.echo(json.dumps(report))
        return
    print_inventory(inv)
    print_parked(parked, tickets)
