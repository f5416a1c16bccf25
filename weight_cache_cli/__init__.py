"""The ``weight-cache`` command: one group, one module per subcommand.

The modules defining the commands import only click and the settings model (pydantic) at the
top: torch, FastAPI and uvicorn are imported inside the commands that use them, so ``--help``
answers at once.
"""

from __future__ import annotations

import click

from protocol.version import __version__
from service.env import check_environment
from service.logs import configure_logging
from weight_cache_cli.attach import attach_command
from weight_cache_cli.demo import demo_checkpoint
from weight_cache_cli.keeper import keeper
from weight_cache_cli.log_options import group_log_options
from weight_cache_cli.openapi import openapi
from weight_cache_cli.parking import parking
from weight_cache_cli.serve import SettingsError, serve
from weight_cache_cli.sizing import sizing
from weight_cache_cli.standby import standby
from weight_cache_cli.status import status


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="weight-cache")
@group_log_options
def cli(log_level: str, log_format: str) -> None:
    """Keep ModelOpt FP8 weights processed and resident; lend them to vLLM engines.

    \b
    Quick start:
      weight-cache serve                  # the built-in demo model on 127.0.0.1:8470
      curl localhost:8470/health
      curl localhost:8470/v1/inventory
      weight-cache status                 # the inventory as a table
      weight-cache attach --check         # attach as an engine would, compare with disk
      weight-cache parking                # parked engines and standbys; release or cancel one
      weight-cache standby -- vllm serve CKPT --load-format weight_cache --enable-sleep-mode ...
                                          # a warm standby: asleep until the serving engine ends
    \b
    With vLLM: vllm serve CKPT --load-format weight_cache \\
        --model-loader-extra-config '{"url": "http://127.0.0.1:8470"}'
    Settings (`serve --help` lists every WEIGHT_CACHE_* variable), error codes, metrics and
    deployment: docs/operating.md.
    """
    configure_logging(log_level, log_format.lower())
    try:
        check_environment()
    except ValueError as exc:
        raise SettingsError(str(exc)) from exc


for command in (
    serve,
    keeper,
    status,
    attach_command,
    parking,
    standby,
    sizing,
    openapi,
    demo_checkpoint,
):
    cli.add_command(command)


def main() -> None:
    cli()
