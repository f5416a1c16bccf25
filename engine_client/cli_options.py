"""The options every command that talks to a daemon takes, in one place."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from engine_client.client import DEFAULT_URL, ClientConfig

F = TypeVar("F", bound=Callable[..., Any])


def daemon_options(command: F) -> F:
    """``--url``, ``--uds`` and ``--token-file`` (also from ``WEIGHT_CACHE_*``)."""
    for option in reversed(
        (
            click.option(
                "--url",
                envvar="WEIGHT_CACHE_URL",
                default=DEFAULT_URL,
                show_default=True,
                help="Daemon URL.",
            ),
            click.option(
                "--uds", envvar="WEIGHT_CACHE_UDS", help="Daemon Unix socket (instead of --url)."
            ),
            click.option(
                "--token-file",
                envvar="WEIGHT_CACHE_TOKEN_FILE",
                type=click.Path(exists=True, dir_okay=False),
                help="Bearer token file.",
            ),
        )
    ):
        command = option(command)
    return command


def client_config(url: str, uds: str | None, token_file: str | None) -> ClientConfig:
    return ClientConfig.from_env(token_file, url=url, uds=uds)
