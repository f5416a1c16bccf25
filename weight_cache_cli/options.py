"""The options every command that talks to a daemon takes, in one place. Unset, each falls back
to the variables the daemon itself reads, so a client finds the daemon it was configured like."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from protocol.client_settings import ClientSettings
from weight_cache_cli.settings_options import settings_option

if TYPE_CHECKING:
    from engine_client.client import ClientConfig

F = TypeVar("F", bound=Callable[..., Any])


def daemon_options(command: F) -> F:
    """``--url``, ``--uds`` and ``--token-file``: the client's settings it takes as options."""
    for name in reversed(ClientSettings.OPTIONS):
        field = ClientSettings.model_fields[name]
        command = settings_option(name, field, client=True)(command)
    return command


def client_config(url: str | None, uds: str | None, token_file: str | Path | None) -> ClientConfig:
    from engine_client.client import ClientConfig

    return ClientConfig.from_env(token_file, url=url, uds=uds)
