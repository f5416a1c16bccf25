"""The options every command that talks to a daemon takes, in one place. Unset, each falls back
to the variables the daemon itself reads, so a client finds the daemon it was configured like."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

if TYPE_CHECKING:
    from engine_client.client import ClientConfig

F = TypeVar("F", bound=Callable[..., Any])


def daemon_options(command: F) -> F:
    """``--url``, ``--uds`` and ``--token-file``."""
    for option in reversed(
        (
            click.option(
                "--url",
                help="Daemon URL [default: $WEIGHT_CACHE_URL, else http://$WEIGHT_CACHE_HOST:"
                "$WEIGHT_CACHE_PORT with the daemon's defaults 127.0.0.1 and 8470].",
            ),
            click.option(
                "--uds", help="Daemon Unix socket, instead of --url [env: WEIGHT_CACHE_UDS]."
            ),
            click.option(
                "--token-file",
                type=click.Path(exists=True, dir_okay=False),
                help="Bearer token file [env: WEIGHT_CACHE_TOKEN_FILE, or the token itself in "
                "WEIGHT_CACHE_TOKEN; a file wins over a value, a flag over the environment].",
            ),
        )
    ):
        command = option(command)
    return command


def client_config(url: str | None, uds: str | None, token_file: str | None) -> ClientConfig:
    from engine_client.client import ClientConfig

    return ClientConfig.from_env(token_file, url=url, uds=uds)
