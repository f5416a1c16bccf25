"""Daemon configuration: ``WEIGHT_CACHE_*`` environment variables, overridden by CLI flags."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.errors import UnauthorizedError
from service.schemas.models import default_model_id
from service.tokens import read_token_file

DEFAULT_PORT = 8470
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


class DaemonSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="WEIGHT_CACHE_", extra="forbid", env_ignore_empty=True
    )

    host: str = "127.0.0.1"
    port: int = Field(default=DEFAULT_PORT, ge=0, le=65535)
    uds: Path | None = Field(default=None, description="serve on this Unix socket instead of TCP")
    models: list[Path] = Field(default_factory=list, description="checkpoints to load at start")
    model_id: str | None = Field(default=None, description="id for the first --model")
    device: str = Field(default="auto", description="auto, cpu, cuda (rank r on GPU r) or cuda:N")
    tp_size: int = Field(default=1, ge=1, le=64)
    token: SecretStr | None = None
    token_file: Path | None = None
    allowed_roots: list[Path] = Field(
        default_factory=list, description="POST /v1/models may only load below these"
    )
    shm_dir: Path = Path("/dev/shm")
    cache_dir: Path = Field(default_factory=lambda: Path.home() / ".cache" / "weight-cache")
    default_ttl_s: float = Field(default=60.0, gt=0)
    max_ttl_s: float = Field(default=3600.0, gt=0)
    reaper_interval_s: float = Field(default=1.0, gt=0)
    memory_budget_bytes: int | None = Field(default=None, ge=0)
    max_body_bytes: int = Field(default=64 * 1024, ge=1024)
    load_threads: int | None = Field(
        default=None, ge=1, description="threads that process a load (default: cores - 1)"
    )

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if not _DEVICE.match(value):
            raise ValueError("device must be auto, cpu, cuda or cuda:N")
        return value

    @model_validator(mode="after")
    def _token_from_file(self) -> DaemonSettings:
        """A token file, when given (by flag or environment), wins over a token value."""
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
