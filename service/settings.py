"""Daemon configuration: ``WEIGHT_CACHE_*`` environment variables, overridden by CLI flags.

Each option has one environment variable named after its flag (``--model`` is
``WEIGHT_CACHE_MODEL``, ``--allowed-root`` is ``WEIGHT_CACHE_ALLOWED_ROOT``); options that take
several values read them separated by ``:`` as ``PATH`` does. A ``WEIGHT_CACHE_*`` variable that
names no option is refused with the closest name, so a typo never passes silently.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import AliasChoices, ByteSize, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from service.errors import UnauthorizedError
from service.schemas.models import default_model_id
from service.tokens import read_token_file
from service.version import DEFAULT_PORT

__all__ = ["DEFAULT_PORT", "DaemonSettings", "check_environment", "env_names"]

ENV_PREFIX = "WEIGHT_CACHE_"
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")

# Variables read outside the daemon's settings: by every client command and the engine loader
# (URL; the clients also read HOST, PORT, UDS, TOKEN and TOKEN_FILE), by the ``weight-cache``
# command itself (LOG_*), and by the benchmarks (BENCH_DIR).
OTHER_VARIABLES = {
    f"{ENV_PREFIX}URL": "daemon URL for client commands and the engine (default: from HOST/PORT)",
    f"{ENV_PREFIX}LOG_LEVEL": "--log-level",
    f"{ENV_PREFIX}LOG_FORMAT": "--log-format",
    f"{ENV_PREFIX}BENCH_DIR": "where the benchmarks write their demo checkpoints",
}


def _env(*names: str) -> AliasChoices:
    """The environment variable(s) of a field whose name differs from its flag's."""
    return AliasChoices(*(ENV_PREFIX + n for n in names))


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
        validation_alias=_env("MODEL"),
        description="checkpoints (directories or Hugging Face repo ids) to load at start",
    )
    model_id: str | None = Field(default=None, description="id for the first --model")
    device: str = Field(default="auto", description="auto, cpu, cuda (rank r on GPU r) or cuda:N")
    tp_size: int = Field(
        default=1, ge=1, le=64, validation_alias=_env("TENSOR_PARALLEL_SIZE", "TP_SIZE")
    )
    token: SecretStr | None = None
    token_file: Path | None = None
    allowed_roots: Annotated[list[Path], NoDecode] = Field(
        default_factory=list,
        validation_alias=_env("ALLOWED_ROOT"),
        description="POST /v1/models may only load below these",
    )
    shm_dir: Path = Path("/dev/shm")
    cache_dir: Path = Field(default_factory=lambda: Path.home() / ".cache" / "weight-cache")
    default_ttl_s: float = Field(
        default=60.0, gt=0, validation_alias=_env("DEFAULT_TTL", "DEFAULT_TTL_S")
    )
    max_ttl_s: float = Field(default=3600.0, gt=0, validation_alias=_env("MAX_TTL", "MAX_TTL_S"))
    reaper_interval_s: float = Field(
        default=1.0, gt=0, validation_alias=_env("REAPER_INTERVAL", "REAPER_INTERVAL_S")
    )
    memory_budget_bytes: ByteSize | None = Field(
        default=None,
        ge=0,
        validation_alias=_env("MEMORY_BUDGET", "MEMORY_BUDGET_BYTES"),
        description="most bytes the cache may hold: 40GiB, 512MB (10^6 bytes) or a byte count",
    )
    max_body_bytes: ByteSize = Field(
        default=ByteSize(64 * 1024), ge=1024, validation_alias=_env("MAX_BODY_SIZE")
    )
    load_threads: int | None = Field(
        default=None, ge=1, description="threads that process a load (default: cores - 1)"
    )
    keep_going: bool = Field(
        default=False, description="keep serving when a startup model fails to load"
    )

    @field_validator("models", "allowed_roots", mode="before")
    @classmethod
    def _paths(cls, value: Any) -> Any:
        return _split_paths(value)

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if not _DEVICE.match(value):
            raise ValueError("device must be auto, cpu, cuda or cuda:N")
        return value

    @model_validator(mode="after")
    def _token_from_file(self) -> DaemonSettings:
        """A token file, when given (by flag or environment), wins over a token value: the one
        precedence rule clients follow too (:func:`service.tokens.resolve_token`)."""
        if self.token_file is not None:
            try:
                self.token = SecretStr(read_token_file(self.token_file))
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
        """Refuse to serve a non-loopback address without a token."""
        if not self.is_loopback and self.token is None:
            raise ValueError(
                f"refusing to bind {self.host} without a token: set --token-file or "
                "WEIGHT_CACHE_TOKEN, or bind a loopback address or a Unix socket"
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


def env_names(field: str) -> list[str]:
    """The environment variable(s) that set ``field``, preferred name first."""
    info = DaemonSettings.model_fields[field]
    alias = info.validation_alias
    if isinstance(alias, AliasChoices):
        return [str(c) for c in alias.choices]
    return [ENV_PREFIX + field.upper()]


def known_variables() -> list[str]:
    names = [n for field in DaemonSettings.model_fields for n in env_names(field)]
    return sorted({*names, *OTHER_VARIABLES})


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Refuse ``WEIGHT_CACHE_*`` variables that configure nothing, naming the closest one."""
    environ = os.environ if environ is None else environ
    known = known_variables()
    unknown = sorted(
        k for k in environ if k.upper().startswith(ENV_PREFIX) and k.upper() not in known
    )
    if not unknown:
        return
    parts = []
    suffixes = [k.removeprefix(ENV_PREFIX) for k in known]  # the shared prefix matches anything
    for name in unknown:
        close = difflib.get_close_matches(name.upper().removeprefix(ENV_PREFIX), suffixes, n=1)
        parts.append(f"{name} (did you mean {ENV_PREFIX}{close[0]}?)" if close else name)
    raise ValueError(
        f"unknown environment variable{'s' if len(parts) > 1 else ''} {', '.join(parts)}; "
        "`weight-cache serve --help` lists every WEIGHT_CACHE_* variable"
    )
