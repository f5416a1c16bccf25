"""What a client of the daemon reads to find and reach it (the engine's loader, the client
commands, the benchmarks), declared with :func:`protocol.setting.setting` as the daemon's
settings are.

A client reads the daemon's own variables too, so that it finds the daemon it was configured
like: where it listens (``HOST``, ``PORT``, ``UDS``) and its token (``TOKEN``, ``TOKEN_FILE``).
Those fields are declared here once, with their defaults, and are fields of both models
(:class:`service.settings.DaemonSettings` and :class:`ClientSettings`); the client's own is the
URL. The benchmarks' one setting is :class:`BenchSettings`.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic_settings import BaseSettings, SettingsConfigDict

from protocol.setting import ENV_PREFIX, Setting, setting, setting_of
from protocol.version import DEFAULT_PORT

DEFAULT_HOST = "127.0.0.1"

# The daemon's settings a client reads too: fields of DaemonSettings and of ClientSettings.
HOST = setting(DEFAULT_HOST, flag="--host", help="Address to bind")
PORT = setting(DEFAULT_PORT, flag="--port", help="TCP port", ge=0, le=65535)
UDS = setting(
    None,
    flag="--uds",
    help="Serve on this Unix socket instead of TCP",
    client_help="Daemon Unix socket, instead of --url",
)
TOKEN = setting(None, variable="TOKEN", help="The bearer token itself (a --token-file wins)")
TOKEN_FILE = setting(
    None,
    flag="--token-file",
    help="File holding the bearer token every route but /health and /ready needs",
    checked_by_cli=True,
    client_help="Bearer token file, or the token itself in "
    f"{setting_of(TOKEN).variable}; a file wins over a value, a flag over the environment",
)

_WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1"}  # a wildcard bind is reached on loopback


class ClientSettings(BaseSettings):
    """Where the daemon is and the token it wants, from a client's flags and options (given as
    keywords) over the environment. A ``url`` given beats an inherited socket."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="ignore", env_ignore_empty=True, populate_by_name=True
    )
    # What a client command takes as options; the others it reads from the environment only.
    OPTIONS: ClassVar[tuple[str, ...]] = ("url", "uds", "token_file")

    url: str | None = setting(
        None,
        flag="--url",
        help="Where client commands (status, attach) and the engine find the daemon",
        shown=f"from {setting_of(HOST).variable}/{setting_of(PORT).variable}",
    )
    uds: str | None = UDS
    token_file: Path | None = TOKEN_FILE
    token: str | None = TOKEN
    host: str = HOST
    port: int = PORT
    standby_group: str | None = setting(
        None,
        variable="STANDBY_GROUP",
        help="Set by `weight-cache standby` for the engine it starts: the group its leases are "
        "taken under, so they count as serving only once the standby is released",
        shown="unset",
    )

    def daemon_url(self) -> str:
        """``url``, else the host and port the daemon binds."""
        if self.url:
            return self.url
        host = _WILDCARDS.get(self.host, self.host)
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"


def client_setting(field: str) -> Setting:
    """A client setting's flag, variables and help, for the messages that name them."""
    return setting_of(ClientSettings.model_fields[field])


class BenchSettings(BaseSettings):
    """The benchmarks' settings."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="ignore", env_ignore_empty=True, populate_by_name=True
    )

    bench_dir: Path = setting(
        variable="BENCH_DIR",
        default_factory=lambda: Path.home() / ".cache" / "weight-cache" / "bench",
        help="Where the benchmarks write their demo checkpoints",
        shown="~/.cache/weight-cache/bench",
    )
