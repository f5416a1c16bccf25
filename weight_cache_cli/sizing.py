"""``weight-cache sizing --engines N``: the ``--gpu-memory-utilization`` that lets N engines
beside the daemon's copy of a model give the GPU away, the weights counted once
(:mod:`engine_client.sizing`), from a running daemon's inventory."""

from __future__ import annotations

import click

from weight_cache_cli.options import client_config, daemon_options


@click.command("sizing")
@daemon_options
@click.option("--engines", type=click.IntRange(1, 64), required=True, help="Engines on the GPU.")
@click.option("--model", help="The daemon's model they serve [default: its only model].")
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of text.")
def sizing(
    url: str | None,
    uds: str | None,
    token_file: str | None,
    engines: int,
    model: str | None,
    as_json: bool,
) -> None:
    """Print each engine's --gpu-memory-utilization for ENGINES engines on the daemon's GPU.

    \b
    One engine keeps vLLM's meaning of the setting (the KV cache the default loader would
    give it). Several engines on one GPU are each charged for the daemon's weights, which
    exist once: this shares out what the daemon's weights, each engine's CUDA context and a
    spare leave, so their KV caches together fill the GPU.
    """
    import json

    from engine_client.client import DaemonClient
    from engine_client.sizing import shared_utilization
    from protocol.errors import WeightCacheError

    try:
        with DaemonClient(client_config(url, uds, token_file)) as client:
            inv = client.inventory()
    except WeightCacheError as exc:
        raise click.ClickException(exc.explain(cli=True)) from exc
    models = [m for m in inv.models if model is None or m.id == model]
    if len(models) != 1:
        names = ", ".join(m.id for m in inv.models) or "none"
        raise click.ClickException(f"name one model with --model (the daemon holds: {names})")
    gpus = [d for d in inv.devices if d.kind.value == "cuda"] or inv.devices
    device = gpus[0]
    held = device.process_memory if device.process_memory is not None else inv.cache_bytes
    weights = models[0].bytes_resident // models[0].tp_size
    try:
        figure = shared_utilization(device.total_memory, held, weights, engines)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(
            json.dumps(
                {
                    "engines": engines,
                    "gpu_memory_utilization": figure.utilization,
                    "engine_budget_bytes": figure.engine_budget_bytes,
                    "device_total_bytes": device.total_memory,
                    "daemon_bytes": held,
                    "weight_bytes": weights,
                }
            )
        )
        return
    click.echo(
        f"{engines} engine(s) of {models[0].id} on {device.name}: "
        f"--gpu-memory-utilization {figure.utilization} each "
        f"({figure.engine_budget_bytes / 2**30:.2f} GiB each beyond the weights)"
    )
