"""The ``weight-cache`` command: one group, one module per subcommand."""

from __future__ import annotations

import logging

import click

from engine_client.cli import attach_command
from service.cli.demo import demo_checkpoint
from service.cli.openapi import openapi
from service.cli.serve import serve
from service.cli.status import status
from service.version import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="weight-cache")
@click.option(
    "--log-level",
    default="INFO",
    show_default=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    help="Logging level for this command.",
)
def cli(log_level: str) -> None:
    """Keep ModelOpt FP8 weights processed and resident; lend them to vLLM engines.

    \b
    Quick start:
      weight-cache serve                  # the built-in demo model on 127.0.0.1:8470
      curl localhost:8470/health
      curl localhost:8470/v1/inventory
      weight-cache status                 # the inventory as a table
      weight-cache attach --check         # attach as an engine would, compare with disk
    \b
    With vLLM: vllm serve CKPT --load-format weight_cache \\
        --model-loader-extra-config '{"url": "http://127.0.0.1:8470"}'
    Error codes, metrics and deployment: README.md.
    """
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise


for command in (serve, status, attach_command, openapi, demo_checkpoint):
    cli.add_command(command)


def main() -> None:
    cli()
