"""``weight-cache parking``: see parked engines and start-up slots, release or cancel one."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import click

from weight_cache_cli.options import client_config, daemon_options

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from engine_client.client import DaemonClient
    from protocol.schemas.parking import ParkedEngine
    from protocol.schemas.startup_slots import SlotTicket

R = TypeVar("R")
Where = tuple[str | None, str | None, str | None]


def _with_client(
    url: str | None, uds: str | None, token_file: str | None, work: Callable[[DaemonClient], R]
) -> R:
    from engine_client.client import DaemonClient
    from protocol.errors import WeightCacheError

    try:
        with DaemonClient(client_config(url, uds, token_file)) as client:
            return work(client)
    except WeightCacheError as exc:
        raise click.ClickException(exc.explain(cli=True)) from exc


def parked_engines(
    client: DaemonClient, method: str = "GET", suffix: str = ""
) -> list[ParkedEngine]:
    """Parked engines: every one the caller may see, or those an action answers with."""
    from engine_client.parking import PARKING

    return client.send(PARKING.listed(method, suffix))


def slot_tickets(client: DaemonClient) -> list[SlotTicket]:
    from engine_client.startup_slot import SLOTS

    return client.send(SLOTS.listed())


def _ago(unix_s: float | None) -> str:
    return "-" if unix_s is None else f"{max(0.0, time.time() - unix_s):.0f} s ago"


def print_parked(engines: list[ParkedEngine], tickets: list[SlotTicket]) -> None:
    """Parked engines and start-up slot tickets as tables (nothing when there are none). The
    ids, which `parking release` and `cancel` take, follow each table whole, one a line: in a
    column they would squeeze the others out of an 80-column terminal, or be cut."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    _print_table(
        console,
        Table("#", "model", "rank", "pid", "state", "parked", "cause", title="Parked engines"),
        [
            (
                e.id,
                [
                    e.model,
                    f"{e.tp_rank}/{e.tp_size}",
                    str(e.client_pid),
                    e.state.value,
                    _ago(e.parked_at),
                    e.cause.value if e.cause else "-",
                ],
            )
            for e in engines
        ],
    )
    _print_table(
        console,
        Table("#", "device", "rank", "pid", "state", "ahead", "asked", title="Start-up slots"),
        [
            (
                t.id,
                [
                    t.device,
                    f"{t.tp_rank}/{t.tp_size}",
                    str(t.client_pid),
                    t.state.value,
                    str(t.ahead),
                    _ago(t.asked_at),
                ],
            )
            for t in tickets
        ],
    )


def _print_table(console: Console, table: Table, rows: list[tuple[str, list[str]]]) -> None:
    """Each row numbered, then each row's id whole, one a line (nothing when there are no
    rows)."""
    if not rows:
        return
    for n, (_, cells) in enumerate(rows, 1):
        table.add_row(str(n), *cells)
    console.print(table)
    for n, (row_id, _) in enumerate(rows, 1):
        console.print(f"#{n} id {row_id}", soft_wrap=True, markup=False, highlight=False)


def _json_option(command: Callable[..., R]) -> Callable[..., R]:
    return click.option(
        "--json", "as_json", is_flag=True, help="Print one JSON object: parked, startup_slots."
    )(command)


def show(engines: list[ParkedEngine], tickets: list[SlotTicket], as_json: bool) -> None:
    """Parked engines and start-up slot tickets as tables, or as one JSON object."""
    if as_json:
        report = {
            "parked": [e.model_dump(mode="json") for e in engines],
            "startup_slots": [t.model_dump(mode="json") for t in tickets],
        }
        click.echo(json.dumps(report))
        return
    if not engines and not tickets:
        click.echo("no parked engines, no start-up slots held or waited for")
    print_parked(engines, tickets)


@click.group("parking", invoke_without_command=True)
@daemon_options
@_json_option
@click.pass_context
def parking(
    ctx: click.Context, url: str | None, uds: str | None, token_file: str | None, as_json: bool
) -> None:
    """Parked engines and start-up slots: list them (the default, or `list`), release or
    cancel one.

    \b
    An engine parks with the loader option {"park": true}: it starts, then waits at its load
    step until an engine on the same model ends, or until released here.
    """
    ctx.obj = (url, uds, token_file)
    if ctx.invoked_subcommand is None:
        _list((url, uds, token_file), as_json)


def _list(where: Where, as_json: bool) -> None:
    engines, tickets = _with_client(*where, lambda c: (parked_engines(c), slot_tickets(c)))
    show(engines, tickets, as_json)


def _where(group: Where, url: str | None, uds: str | None, token_file: str | None) -> Where:
    """The daemon a subcommand talks to: its own options, else the group's."""
    return (url or group[0], uds or group[1], token_file or group[2])


@parking.command("list")
@daemon_options
@_json_option
@click.pass_obj
def list_command(
    group: Where, url: str | None, uds: str | None, token_file: str | None, as_json: bool
) -> None:
    """List parked engines and start-up slot tickets (as `weight-cache parking` does)."""
    _list(_where(group, url, uds, token_file), as_json)


@parking.command("release")
@click.argument("parked_id", required=False)
@click.option("--model", help="Release the oldest engine parked for this model.")
@click.option("--tp-size", type=int, help="With --model: only engines of this TP size.")
@daemon_options
@click.pass_obj
def release(
    group: Where,
    parked_id: str | None,
    model: str | None,
    tp_size: int | None,
    url: str | None,
    uds: str | None,
    token_file: str | None,
) -> None:
    """Release one parked engine (every TP rank): PARKED_ID, or the oldest of --model."""
    if parked_id is not None and model is not None:
        raise click.UsageError("give a PARKED_ID or --model, not both")
    if parked_id is None and model is None:
        raise click.UsageError(
            "give the PARKED_ID of an engine (`weight-cache parking` lists them), or --model "
            "to release the oldest parked for that model"
        )
    if model is not None:
        path = f"/models/{model}/release" + (f"?tp_size={tp_size}" if tp_size else "")
    else:
        path = f"/{parked_id}/release"
    where = _where(group, url, uds, token_file)
    released = _with_client(*where, lambda c: parked_engines(c, "POST", path))
    print_parked(released, [])


@parking.command("cancel")
@click.argument("parked_id")
@daemon_options
@click.pass_obj
def cancel(
    group: Where, parked_id: str, url: str | None, uds: str | None, token_file: str | None
) -> None:
    """Cancel a parked engine (every TP rank): it falls back to vLLM's default loader, or fails
    if its loader option "fallback" is false. To stop it outright, end its process (PID)."""
    where = _where(group, url, uds, token_file)
    cancelled = _with_client(*where, lambda c: parked_engines(c, "POST", f"/{parked_id}/cancel"))
    print_parked(cancelled, [])
