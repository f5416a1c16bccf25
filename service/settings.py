"""Daemon configuration: ``WEIGHT_CACHE_*`` environment variables, overridden by CLI flags.

Each option has one environment variable named after its flag (``--model`` is
``WEIGHT_CACHE_MODEL``, ``--allowed-root`` is ``WEIGHT_CACHE_ALLOWED_ROOT``); options that take
several values read them separated by ``:`` as ``PATH`` does. A ``WEIGHT_CACHE_*`` variable that
names no option is refused with the closest name, so a typo never passes silently.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    AliasChoices,
    ByteSize,
    Field,
    SecretStr,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from protocol.errors import UnauthorizedError
from protocol.schemas.models import default_model_id
from protocol.tokens import choose_token, exposed_token_file, header_safe, read_token_file
from protocol.version import DEFAULT_PORT
from service.env import ENV_PREFIX, check_environment, env_names, known_variables

__all__ = ["DEFAULT_PORT", "DaemonSettings", "check_environment", "env_names", "known_variables"]

MIN_EXPOSED_TOKEN_CHARS = 16  # for a bind other than loopback or a Unix socket
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
_BYTE_SIZE = TypeAdapter(ByteSize)


def _env(field: str) -> AliasChoices:
    """The environment variable(s) of a field whose name differs from its flag's."""
    return AliasChoices(*env_names(field))


def _split_paths(value: Any) -> Any:
    """``a:b`` (as in PATH) from the environment; lists from flags and code pass through."""
    if isinstance(value, str):
        return [p for p in value.split(os.pathsep) if p]
    return value


class DaemonSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="forbid", env_ignore_empty=True, populate_by_name=True
    )

    host: str = "127.0.0.1"
    port: int = Field(default=DEFAULT_PORT, ge=0, le=65535)
    uds: Path | None = Field(default=None, description="serve on this Unix socket instead of TCP")
    models: Annotated[list[Path], NoDecode] = Field(
        default_factory=list,
        validation_alias=_env("models"),
        description="checkpoints (directories or Hugging Face repo ids) to load at start",
    )
    model_id: str | None = Field(default=None, description="id for the first --model")
    device: str = Field(default="auto", description="auto, cpu, cuda (rank r on GPU r) or cuda:N")
    tp_size: int = Field(default=1, ge=1, le=64, validation_alias=_env("tp_size"))
    token: SecretStr | None = None
    token_file: Path | None = None
    allowed_roots: Annotated[list[Path], NoDecode] = Field(
        default_factory=list,
        validation_alias=_env("allowed_roots"),
        description="POST /v1/models may only load below these",
    )
    shm_dir: Path = Path("/dev/shm")
    cache_dir: Path = Field(default_factory=lambda: Path.home() / ".cache" / "weight-cache")
    default_ttl_s: float = Field(default=60.0, gt=0, validation_alias=_env("default_ttl_s"))
    max_ttl_s: float = Field(default=3600.0, gt=0, validation_alias=_env("max_ttl_s"))
    reaper_interval_s: float = Field(default=1.0, gt=0, validation_alias=_env("reaper_interval_s"))
    memory_budget_bytes: ByteSize | None = Field(
        default=None,
        ge=0,
        validation_alias=_env("memory_budget_bytes"),
        description="most bytes the cache may hold: 40GiB, 512MB (10^6 bytes) or a byte count",
    )
    max_body_bytes: ByteSize = Field(
        default=ByteSize(64 * 1024), ge=1024, validation_alias=_env("max_body_bytes")
    )
    load_threads: int | None = Field(
        default=None, ge=1, description="threads that process a load (default: cores - 1)"
    )
    load_nice: int = Field(
        default=10,
        ge=0,
        le=19,
        description="niceness the loading threads add to the daemon's (requests run first)",
    )
    shm_group: str | None = Field(
        default=None,
        description="group that may map arenas (dir 0750, files 0640); default: owner only",
    )
    scrub_interval_s: float = Field(
        default=0.0,
        ge=0,
        description="re-check resident arenas' checksums every N s (0: off)",
        validation_alias=_env("scrub_interval_s"),
    )
    max_leases: int = Field(default=4096, ge=1, description="active leases, all clients")
    max_leases_per_client: int = Field(
        default=256, ge=1, description="active leases of one client process"
    )
    max_leases_per_uid: int = Field(
        default=1024,
        ge=1,
        description="active leases of one user (a quarter of --max-leases by default, so "
        "one user cannot take the others' room)",
    )
    max_models: int = Field(
        default=64, ge=1, description="models registered at once, failed ones included"
    )
    max_concurrent_loads: int = Field(
        default=4, ge=1, description="loads running at once; more are refused with 429"
    )
    max_connections: int = Field(default=256, ge=1, description="open HTTP connections")
    max_header_bytes: int = Field(
        default=32 * 1024, ge=1024, description="request line and headers of one request"
    )
    request_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="time a client has to send a whole request",
        validation_alias=_env("request_timeout_s"),
    )
    follow_symlinks: bool = Field(
        default=True,
        description="API loads may name symlinked checkpoints/files (targets must stay below "
        "an allowed root); false refuses them",
    )
    keep_going: bool = Field(
        default=False, description="keep serving when a startup model fails to load"
    )
    socket_group: str | None = Field(
        default=None,
        description="group that may use the --uds socket (mode 0660); default: the daemon's "
        "user only (0600)",
    )
    trust_local_users: bool = Field(
        default=False,
        description="without a token, serve every local user over loopback TCP (default: "
        "only the daemon's user and root; others use the Unix socket or the token)",
    )

    def __init__(self, **values: Any) -> None:
        """The token is chosen here, by :func:`protocol.tokens.choose_token` as clients choose
        theirs, from what was given (flags, keywords) and the environment: once pydantic-settings
        has merged the two it cannot tell them apart."""
        token = values.pop("token", None)
        if isinstance(token, SecretStr):
            token = token.get_secret_value()
        value, file = choose_token(token, values.pop("token_file", None))
        super().__init__(**values, token=value, token_file=file)

    @field_validator("models", "allowed_roots", mode="before")
    @classmethod
    def _paths(cls, value: Any) -> Any:
        return _split_paths(value)

    @field_validator("memory_budget_bytes", "max_body_bytes", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        """A size as bytes or a number and a unit, said plainly when it is neither."""
        if isinstance(value, str):
            text = value.strip()
            try:
                return _BYTE_SIZE.validate_python(text)
            except ValidationError:
                raise ValueError(
                    f"{value!r} is not a size: give a byte count (1073741824) or a number and "
                    "a unit: 40GiB, 512MiB (powers of 1024), 40GB, 512MB (powers of 1000)"
                ) from None
        return value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if not _DEVICE.match(value):
            raise ValueError("device must be auto, cpu, cuda or cuda:N")
        return value

    @model_validator(mode="after")
    def _token_from_file(self) -> DaemonSettings:
        """Read the token file :func:`protocol.tokens.choose_token` chose, if it chose one. A
        token is compared without surrounding whitespace, and one of whitespace alone is no
        token."""
        if self.token_file is not None:
            try:
                self.token = SecretStr(read_token_file(self.token_file))
            except UnauthorizedError as exc:
                raise ValueError(exc.detail) from exc
            exposed = exposed_token_file(self.token_file)
            if exposed is not None:
                raise ValueError(exposed)
        if self.token is not None:
            value = self.token.get_secret_value().strip()
            if not value:
                raise ValueError("the token is empty or whitespace only")
            try:
                self.token = SecretStr(header_safe(value))
            except UnauthorizedError as exc:
                raise ValueError(exc.detail) from exc
        return self

    def startup_models(self) -> list[tuple[Path, str]]:
        """(path, id) of every --model; the first takes --model-id. Ids must be unique."""
        pairs = [
            (path, self.model_id if i == 0 and self.model_id else default_model_id(path))
            for i, path in enumerate(self.models)
        ]
        ids = [model_id for _, model_id in pairs]
        if len(set(ids)) != len(ids):
            dupes = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(
                f"two --model checkpoints get the same id {', '.join(dupes)}: give the first "
                "--model-id, or load the others over the API with their own ids"
            )
        return pairs

    @property
    def is_loopback(self) -> bool:
        if self.uds is not None:
            return True
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def check_exposure(self) -> None:
        """Refuse to serve a non-loopback address without a strong enough token."""
        if self.is_loopback:
            return
        if self.token is None:
            raise ValueError(
                f"refusing to bind {self.host} without a token: set --token-file or "
                "WEIGHT_CACHE_TOKEN, or bind a loopback address or a Unix socket"
            )
        strength = sum(1 for c in self.token.get_secret_value() if not c.isspace())
        if strength < MIN_EXPOSED_TOKEN_CHARS:
            raise ValueError(
                f"refusing to bind {self.host} with a token of {strength} non-space characters: "
                f"use at least {MIN_EXPOSED_TOKEN_CHARS} (e.g. `openssl rand -hex 16`)"
            )

    def check_directories(self) -> None:
        """Directories the daemon needs must exist before it binds or loads anything."""
        needed: list[tuple[str, Path]] = [("--shm-dir", self.shm_dir)]
        needed += [("--allowed-root", root) for root in self.allowed_roots]
        if self.uds is not None:
            needed.append(("--uds (its directory)", self.uds.parent))
        for flag, path in needed:
            if not path.is_dir():
                raise ValueError(f"{flag} {path} is not an existing directory")
        if not os.access(self.shm_dir, os.W_OK | os.X_OK):
            raise ValueError(f"--shm-dir {self.shm_dir} is not writable by this user")
