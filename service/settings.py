"""Daemon configuration: one definition per setting, read from ``WEIGHT_CACHE_*`` variables and
overridden by ``weight-cache serve``'s flags.

Each field of :class:`DaemonSettings` is declared with :func:`protocol.setting.setting`, which
carries its flag, its environment variable (named after the flag; older spellings still read),
its help and its default. The command's options, the known-variable rules that refuse a typo
and the operator's guide's settings table (docs/operating.md) are all made from these fields;
nothing else lists a setting.

How to add one: :mod:`protocol.setting`. Where the daemon listens and its token are declared in
:mod:`protocol.client_settings`, whose clients read them too.

Options that take several values (``list`` fields) read them from their variable separated by
``:``, as ``PATH`` does.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    ByteSize,
    SecretStr,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from protocol.client_settings import HOST, PORT, TOKEN, TOKEN_FILE, UDS
from protocol.errors import UnauthorizedError
from protocol.schemas.tensor_parallel import MAX_TP_SIZE
from protocol.setting import ENV_PREFIX, setting, setting_of
from protocol.tokens import choose_token, clean_token, read_token_file, untrusted_token_file
from service.run_dir import default_run_dir

__all__ = ["DaemonSettings"]

MIN_EXPOSED_TOKEN_CHARS = 16  # for a bind other than loopback or a Unix socket
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
_BYTE_SIZE = TypeAdapter(ByteSize)


def _split_paths(value: Any) -> Any:
    """``a:b`` (as in PATH) from the environment, lists from flags and code; empty entries
    name nothing (``--model ''`` is no model, never the current directory)."""
    if isinstance(value, str):
        value = value.split(os.pathsep)
    if isinstance(value, (list, tuple)):
        return [p for p in value if str(p) != ""]
    return value


class DaemonSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="forbid", env_ignore_empty=True, populate_by_name=True
    )

    # None: no --model given, and the daemon serves its demo model; [] (`--model ''`, or
    # WEIGHT_CACHE_MODEL set and empty): no model at start.
    models: Annotated[list[Path] | None, NoDecode] = setting(
        None,
        flag="--model",
        help="Checkpoint directory, or a Hugging Face repo id already in the local HF cache "
        "(HF_HOME / HF_HUB_CACHE), to load at start; empty: none",
        shown="the built-in demo model",
    )
    model_id: str | None = setting(
        None, flag="--model-id", help="Id of the first --model", shown="its directory name"
    )
    host: str = HOST
    port: int = PORT
    uds: Path | None = UDS
    device: str = setting(
        "auto", flag="--device", help="auto, cpu, cuda (rank r on GPU r) or cuda:N"
    )
    tp_size: int = setting(
        1,
        flag="--tensor-parallel-size",
        also=("--tp-size",),
        older=("TP_SIZE",),
        help="Tensor-parallel size of the --model loads",
        ge=1,
        le=MAX_TP_SIZE,
    )
    token: SecretStr | None = TOKEN
    token_file: Path | None = TOKEN_FILE
    allowed_roots: Annotated[list[Path], NoDecode] = setting(
        flag="--allowed-root",
        default_factory=list,
        help="POST /v1/models may load checkpoints below this directory",
        shown="none, API loads off",
    )
    shm_dir: Path = setting(
        Path("/dev/shm"), flag="--shm-dir", help="Shared-memory arena directory"
    )
    cache_dir: Path = setting(
        flag="--cache-dir",
        default_factory=lambda: Path.home() / ".cache" / "weight-cache",
        help="Where the demo checkpoint is written",
        shown="~/.cache/weight-cache",
    )
    memory_budget_bytes: ByteSize | None = setting(
        None,
        flag="--memory-budget",
        also=("--memory-budget-bytes",),
        older=("MEMORY_BUDGET_BYTES",),
        help="Most bytes the cache may hold: 40GiB, 512MB (10^6 bytes) or a byte count",
        shown="unbounded",
        ge=0,
    )
    max_body_bytes: ByteSize = setting(
        ByteSize(64 * 1024),
        flag="--max-body-size",
        help="Largest request body",
        shown="64KiB",
        ge=1024,
    )
    max_donation_body_bytes: ByteSize = setting(
        ByteSize(16 * 1024 * 1024),
        flag="--max-donation-body-size",
        help="Largest body of a donation's offer or commit (they list every tensor of a rank), "
        "from a caller allowed to donate",
        shown="16MiB",
        ge=1024,
    )
    default_ttl_s: float = setting(
        60.0,
        flag="--default-ttl",
        older=("DEFAULT_TTL_S",),
        help="Lease TTL in seconds when a request names none",
        gt=0,
    )
    max_ttl_s: float = setting(
        3600.0, flag="--max-ttl", older=("MAX_TTL_S",), help="Longest lease TTL in seconds", gt=0
    )
    reaper_interval_s: float = setting(
        1.0,
        flag="--reaper-interval",
        older=("REAPER_INTERVAL_S",),
        help="Seconds between sweeps for expired leases and dead clients",
        gt=0,
    )
    load_threads: int | None = setting(
        None,
        flag="--load-threads",
        help="Threads that process a load",
        shown="cores - 1",
        ge=1,
    )
    load_nice: int = setting(
        10,
        flag="--load-nice",
        help="Niceness the loading threads add to the daemon's, so requests run first on a "
        "busy machine (0: same priority)",
        checked_by_cli=True,
        ge=0,
        le=19,
    )
    shm_group: str | None = setting(
        None,
        flag="--shm-group",
        help="Group that may map CPU arenas (directory 0750, files 0640)",
        shown="owner only",
    )
    scrub_interval_s: float = setting(
        0.0,
        flag="--scrub-interval",
        older=("SCRUB_INTERVAL_S",),
        help="Re-check resident arenas against their checksums every N seconds",
        shown="0, off",
        ge=0,
    )
    max_leases: int = setting(4096, flag="--max-leases", help="Most active leases in all", ge=1)
    max_leases_per_client: int = setting(
        256, flag="--max-leases-per-client", help="Most active leases of one client PID", ge=1
    )
    max_leases_per_uid: int = setting(
        1024,
        flag="--max-leases-per-uid",
        help="Most active leases of one user, so one user cannot take the others' room",
        ge=1,
    )
    max_models: int = setting(
        64, flag="--max-models", help="Most models registered at once, failed ones included", ge=1
    )
    max_concurrent_loads: int = setting(
        4,
        flag="--max-concurrent-loads",
        help="Most loads running at once; POST /v1/models beyond is refused with 429",
        ge=1,
    )
    max_connections: int = setting(
        256,
        flag="--max-connections",
        help="Most open HTTP connections; more are answered 503 (16 more are let in for "
        "/health and /ready alone)",
        ge=1,
    )
    max_requests_per_caller: int | None = setting(
        None,
        flag="--max-requests-per-caller",
        help="Most requests of one caller (a user, or the token's holders) in the daemon's hands "
        "at once, long-polls and bodies still arriving included; more are answered 429 "
        "(/health and /ready never count)",
        shown="a quarter of --max-connections",
        ge=1,
    )
    max_header_bytes: int = setting(
        32 * 1024,
        flag="--max-header-bytes",
        help="Largest request line and headers of one request",
        ge=1024,
    )
    request_timeout_s: float = setting(
        10.0,
        flag="--request-timeout",
        older=("REQUEST_TIMEOUT_S",),
        help="Seconds a client has to send a whole request",
        gt=0,
    )
    follow_symlinks: bool = setting(
        True,
        flag="--follow-symlinks",
        help="Let API loads name symlinked checkpoints and files whose targets stay below an "
        "allowed root",
        shown="follow",
    )
    keep_going: bool = setting(
        False,
        flag="--keep-going",
        help="Keep serving when a startup model fails to load, and report ready once every "
        "startup model is ready or failed",
        shown="exit with status 1",
    )
    max_parked: int = setting(
        64,
        flag="--max-parked",
        help="Most parked engines (ranks) in all, and as many start-up slot tickets",
        ge=1,
    )
    max_parked_per_client: int = setting(
        4,
        flag="--max-parked-per-client",
        help="Most engines waiting (parked, warm standbys), and start-up slot groups, of one "
        "process (the ranks of one engine count once)",
        ge=1,
    )
    max_parked_per_uid: int = setting(
        16,
        flag="--max-parked-per-uid",
        help="Most parked engines (ranks), and start-up slot tickets, of one user",
        ge=1,
    )
    startup_slot_hold_s: float = setting(
        600.0,
        flag="--startup-slot-hold",
        help="Seconds an engine may hold its GPU's start-up slot before the next engine gets it",
        gt=0,
    )
    cuda_handles: Literal["fd", "ipc"] = setting(
        "fd",
        flag="--cuda-handles",
        help="GPU arenas as shareable allocations passed to engines as file descriptors over "
        "<run-dir>/handles.sock (fd), or legacy CUDA IPC, which needs the engine in the daemon's "
        "PID and IPC namespaces (ipc)",
    )
    run_dir: Path = setting(
        flag="--run-dir",
        default_factory=default_run_dir,
        help="Directory of the handle socket and the keeper's socket; in containers "
        "/run/weight-cache, shared with the keeper and the engines",
        shown="$XDG_RUNTIME_DIR/weight-cache, /run/weight-cache for root, else "
        "/tmp/weight-cache-u<uid>",
    )
    keeper: Literal["auto", "external", "off"] = setting(
        "auto",
        flag="--keeper",
        help="A keeper process holds the arenas so that a restarted daemon takes them over: auto "
        "starts one (detached) if none answers on <run-dir>/keeper.sock, external requires one "
        "(`weight-cache keeper`, e.g. a sidecar), off frees them with the daemon",
    )
    socket_group: str | None = setting(
        None,
        flag="--socket-group",
        help="Group that may use the --uds socket (mode 0660)",
        shown="the daemon's user only, 0600",
    )
    trust_local_users: bool = setting(
        False,
        flag="--trust-local-users",
        help="Without a token, serve every local user over loopback TCP",
        shown="only the daemon's user and root; others use the Unix socket or the token",
    )

    allow_token_donations: bool = setting(
        False,
        flag="--allow-token-donations",
        help="Let token holders donate models (an engine's processed weights others compute with)",
        shown="only the daemon's user and root donate",
    )

    def __init__(self, **values: Any) -> None:
        """The token is chosen here, by :func:`protocol.tokens.choose_token` as clients choose
        theirs, from what was given (flags, keywords) and the environment: once pydantic-settings
        has merged the two it cannot tell them apart."""
        token = values.pop("token", None)
        if isinstance(token, SecretStr):
            token = token.get_secret_value()
        value, file = choose_token(token, values.pop("token_file", None))
        if "models" not in values and any(
            os.environ.get(name) == ""
            for name in setting_of(type(self).model_fields["models"]).variables
        ):
            values["models"] = []  # set and empty: no model (other empty variables are unset)
        super().__init__(**values, token=value, token_file=file)

    @field_validator("models", "allowed_roots", mode="before")
    @classmethod
    def _paths(cls, value: Any) -> Any:
        return _split_paths(value)

    @field_validator(
        "memory_budget_bytes", "max_body_bytes", "max_donation_body_bytes", mode="before"
    )
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
            untrusted = untrusted_token_file(self.token_file)
            if untrusted is not None:
                raise ValueError(untrusted)
        if self.token is not None:
            try:
                self.token = SecretStr(clean_token(self.token.get_secret_value()))
            except UnauthorizedError as exc:
                raise ValueError(exc.detail) from exc
        return self

    def startup_models(self) -> list[tuple[Path, str]]:
        """(path, id) of every --model; the first takes --model-id. Ids must be unique."""
        from protocol.schemas.models import default_model_id  # imports torch: not for --help

        pairs = [
            (path, self.model_id if i == 0 and self.model_id else default_model_id(path))
            for i, path in enumerate(self.models or [])
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
    def requests_per_caller(self) -> int:
        """``--max-requests-per-caller``, by default a quarter of ``--max-connections``: well
        below the connection cap, so one caller never holds them all."""
        return self.max_requests_per_caller or max(1, self.max_connections // 4)

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
                f"refusing to bind {self.host} without a token: set {_flag('token_file')} or "
                f"{_variable('token')}, or bind a loopback address or a Unix socket"
            )
        strength = sum(1 for c in self.token.get_secret_value() if not c.isspace())
        if strength < MIN_EXPOSED_TOKEN_CHARS:
            raise ValueError(
                f"refusing to bind {self.host} with a token of {strength} non-space characters: "
                f"use at least {MIN_EXPOSED_TOKEN_CHARS} (e.g. `openssl rand -hex 16`)"
            )

    def check_directories(self) -> None:
        """Directories the daemon needs must exist before it binds or loads anything."""
        needed: list[tuple[str, Path]] = [(_flag("shm_dir"), self.shm_dir)]
        needed += [(_flag("allowed_roots"), root) for root in self.allowed_roots]
        if self.uds is not None:
            needed.append((f"{_flag('uds')} (its directory)", self.uds.parent))
        for flag, path in needed:
            if not path.is_dir():
                raise ValueError(f"{flag} {path} is not an existing directory")
        if not os.access(self.shm_dir, os.W_OK | os.X_OK):
            raise ValueError(f"{_flag('shm_dir')} {self.shm_dir} is not writable by this user")


def _flag(field: str) -> str:
    """The flag of the daemon's setting ``field``, for the messages that name it."""
    return setting_of(DaemonSettings.model_fields[field]).flag


def _variable(field: str) -> str:
    return setting_of(DaemonSettings.model_fields[field]).variable
