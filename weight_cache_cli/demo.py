"""``weight-cache demo-checkpoint``: write a deterministic demo checkpoint (ModelOpt FP8, which
the daemon processes; block FP8 or bf16, which engines donate)."""

from __future__ import annotations

from pathlib import Path

import click

# The choices only: service.demo itself (torch) is imported when the command runs.
SCHEMES = ("fp8", "fp8-pc-pt", "fp8-block", "bf16")
SHAPES = ("tiny", "tiny-128", "qwen2.5-0.5b", "llama-8b")


@click.command("demo-checkpoint", context_settings={"show_default": True})
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--scheme",
    type=click.Choice(SCHEMES),
    default="fp8",
    help="The export format: fp8 is ModelOpt's FP8 (per-tensor scales), fp8-pc-pt its "
    "FP8_PER_CHANNEL_PER_TOKEN (both processed by the daemon); fp8-block is block FP8 as "
    "Qwen3-FP8 exports it (128x128 blocks, weight_scale_inv), bf16 is unquantized (both loaded "
    "by vLLM and donated).",
)
@click.option(
    "--shape",
    type=click.Choice(SHAPES),
    default="tiny",
    help="The model's dimensions: tiny (the demo model, 128 KiB), tiny-128 (1 to 2 MiB, widths "
    "block FP8's blocks divide), qwen2.5-0.5b's or Llama-3.1-8B's (9.1 GB).",
)
@click.option(
    "--seed",
    type=int,
    default=0,
    help="Seed of the random weights: another seed is another checkpoint of the same shape.",
)
@click.option(
    "--shard-size-mb",
    type=click.IntRange(min=1),
    default=4096,
    help="Split safetensors files above this size, with an index.",
)
@click.option(
    "--device",
    default="cpu",
    help="Draw the random weights here (cuda writes an 8B shape in seconds; other values).",
)
def demo_checkpoint(
    out: Path, scheme: str, shape: str, seed: int, shard_size_mb: int, device: str
) -> None:
    """Write a demo checkpoint to OUT (no network)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    from service.demo import SHAPES as SHAPE_DIMS
    from service.demo import expected_bytes, write_demo_checkpoint

    total = expected_bytes(SHAPE_DIMS[shape])
    columns = (
        *Progress.get_default_columns()[:-1],
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, transient=True, disable=total < (64 << 20)) as progress:
        task = progress.add_task(f"{shape} {scheme}", total=total)
        write_demo_checkpoint(
            out,
            scheme,
            shape,
            seed,
            shard_bytes=shard_size_mb << 20,
            device=device,
            progress=lambda n: progress.advance(task, n),
        )
    click.echo(str(out))
