"""``weight-cache attach``: attach as an engine would, run every layer, optionally compare with an
ordinary load of the same checkpoint."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from weight_cache_cli.options import client_config, daemon_options

if TYPE_CHECKING:  # imported when the command runs: `weight-cache --help` needs no torch
    import torch

    from engine_client.attach import Attachment
    from engine_client.client import DaemonClient
    from protocol.schemas.layout import LayerLayout


# modelopt_fp8.checkpoint.IdentityTier, spelled out so --help imports no torch (a test compares).
IDENTITY_TIERS = ("files", "sampled", "hf_blob", "full")


def run_layers(
    layers: list[LayerLayout],
    tensors: dict[str, torch.Tensor],
    device: torch.device,
    seed: int = 0,
    tokens: int = 8,
) -> dict[str, torch.Tensor]:
    """Every layer's output on a fixed bf16 input (same input for every source)."""
    import torch

    from engine_client.fp8_linear import Fp8LinearWeights, fp8_linear

    out = {}
    gen = torch.Generator().manual_seed(seed)
    for layout in layers:
        x = (torch.randn(tokens, layout.input_size, generator=gen) * 0.5).to(torch.bfloat16)
        w = Fp8LinearWeights.from_tensors(layout, tensors)
        out[layout.name] = fp8_linear(x.to(device), w)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out


def _pick_model(client: DaemonClient) -> str:
    from protocol.schemas.models import ModelState

    ready = [m.id for m in client.models() if m.state is ModelState.ready]
    if len(ready) != 1:
        raise click.UsageError(f"pass --model; ready models: {', '.join(ready) or 'none'}")
    return ready[0]


@click.command("attach", context_settings={"show_default": True})
@daemon_options
@click.option("--model", "model_id", help="Model id (default: the only ready model).")
@click.option(
    "--tp-rank",
    type=click.IntRange(min=0),
    default=0,
    help="The tensor-parallel rank to lease, as an engine's worker of that rank would.",
)
@click.option(
    "--tensor-parallel-size",
    "--tp-size",
    "tp_size",
    type=click.IntRange(min=1),
    default=1,
    help="The TP size the model was loaded with (the daemon's --tensor-parallel-size).",
)
@click.option("--device", default="auto", help="auto (cuda:0 when present), cpu or cuda:N.")
@click.option(
    "--checkpoint",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="This engine's copy of the checkpoint (default: the daemon's path).",
)
@click.option(
    "--identity",
    type=click.Choice(IDENTITY_TIERS),
    default="sampled",
    help="How to check the checkpoint is the daemon's (full: hash every byte).",
)
@click.option("--check", is_flag=True, help="Compare every layer with an ordinary disk load.")
@click.option("--verify-checksums", is_flag=True, help="Hash every mapped byte against the lease.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def attach_command(
    url: str | None,
    uds: str | None,
    token_file: str | None,
    model_id: str | None,
    tp_rank: int,
    tp_size: int,
    device: str,
    checkpoint: Path | None,
    identity: str,
    check: bool,
    verify_checksums: bool,
    as_json: bool,
) -> None:
    """Attach to a model as an engine would and run every layer on a fixed input."""
    from engine_client.attach import attach
    from engine_client.client import DaemonClient
    from engine_client.fallback import reason_of
    from engine_client.verify import Expectations
    from modelopt_fp8.checkpoint import IdentityTier
    from protocol.errors import WeightCacheError

    config = client_config(url, uds, token_file)
    dev = _device(device)
    try:
        with DaemonClient(config) as client:
            model_id = model_id or _pick_model(client)
            path = checkpoint or Path(client.model(model_id).path)
        expect = Expectations.for_checkpoint(
            path,
            dev,
            IdentityTier(identity),
            tp_rank=tp_rank,
            tp_size=tp_size,
            verify_checksums=verify_checksums,
        )
        with attach(model_id, expect, config=config, keep_alive=False) as att:
            outputs = run_layers(att.layers, att.tensors, dev)
            report = _report(att, model_id, dev)
            if check:
                report.update(_against_disk(path, dev, tp_rank, tp_size, att.layers, outputs))
    except WeightCacheError as exc:
        raise click.ClickException(
            f"{exc.explain(cli=True)} (reason: {reason_of(exc).value})"
        ) from exc
    if as_json:
        click.echo(json.dumps(report))
        return
    for key, value in report.items():
        click.echo(f"{key:>18}: {value}")
    if check and not report["matches_disk_load"]:
        raise click.ClickException("attached layers differ from an ordinary load")


def _device(name: str) -> torch.device:
    """``auto``: the first GPU when there is one, else the CPU."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def _report(att: Attachment, model_id: str, dev: torch.device) -> dict[str, Any]:
    """What the attachment holds and what each of its steps took."""
    timings = att.timings
    return {
        "model": model_id,
        "device": str(dev),
        "tensors": len(att.tensors),
        "layers": len(att.layers),
        "bytes": att.nbytes,
        "lease_ms": round(timings.lease_ms, 3),
        "attach_ms": round(timings.attach_ms, 3),
        "open_ms": round(timings.open_ms, 3),
        "rebuild_ms": round(timings.rebuild_ms, 3),
        "verify_ms": round(timings.verify_ms, 3),
        "zero_copy": att.zero_copy(),
        "matches_disk_load": None,
    }


def _against_disk(
    path: Path,
    dev: torch.device,
    tp_rank: int,
    tp_size: int,
    leased: list[LayerLayout],
    outputs: dict[str, torch.Tensor],
) -> dict[str, Any]:
    """An ordinary load of ``path``: how long it took, and whether its layers and outputs are
    the leased ones'."""
    import torch

    from engine_client.checkpoint_read import read_checkpoint

    start = time.perf_counter()
    disk, layers = read_checkpoint(path, dev, tp_rank, tp_size)
    took_ms = round((time.perf_counter() - start) * 1e3, 3)
    expected = run_layers(layers, disk, dev)
    same = layers == leased and all(torch.equal(outputs[n], expected[n]) for n in expected)
    return {"disk_load_ms": took_ms, "matches_disk_load": same}
