"""The ``WEIGHT_CACHE_*`` variable names, without pydantic: the settings build on them, and
``--help`` names them without importing anything heavier than this."""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping

ENV_PREFIX = "WEIGHT_CACHE_"

# Every field of service.settings.DaemonSettings (a test keeps the two equal).
SETTINGS_FIELDS = (
    "host",
    "port",
    "uds",
    "models",
    "model_id",
    "device",
    "tp_size",
    "token",
    "token_file",
    "allowed_roots",
    "shm_dir",
    "cache_dir",
    "default_ttl_s",
    "max_ttl_s",
    "reaper_interval_s",
    "memory_budget_bytes",
    "max_body_bytes",
    "load_threads",
    "load_nice",
    "shm_group",
    "scrub_interval_s",
    "max_leases",
    "max_leases_per_client",
    "max_leases_per_uid",
    "max_models",
    "max_concurrent_loads",
    "max_connections",
    "max_header_bytes",
    "request_timeout_s",
    "follow_symlinks",
    "keep_going",
    "socket_group",
    "trust_local_users",
)

# Fields whose variable is named after the flag rather than the field (preferred name first;
# later names are older spellings, still read).
ALIASES: dict[str, tuple[str, ...]] = {
    "models": ("MODEL",),
    "allowed_roots": ("ALLOWED_ROOT",),
    "tp_size": ("TENSOR_PARALLEL_SIZE", "TP_SIZE"),
    "memory_budget_bytes": ("MEMORY_BUDGET", "MEMORY_BUDGET_BYTES"),
    "max_body_bytes": ("MAX_BODY_SIZE",),
    "default_ttl_s": ("DEFAULT_TTL", "DEFAULT_TTL_S"),
    "max_ttl_s": ("MAX_TTL", "MAX_TTL_S"),
    "reaper_interval_s": ("REAPER_INTERVAL", "REAPER_INTERVAL_S"),
    "scrub_interval_s": ("SCRUB_INTERVAL", "SCRUB_INTERVAL_S"),
    "request_timeout_s": ("REQUEST_TIMEOUT", "REQUEST_TIMEOUT_S"),
}

# Variables read outside the daemon's settings: by every client command and the engine loader
# (URL; the clients also read HOST, PORT, UDS, TOKEN and TOKEN_FILE), by the ``weight-cache``
# command itself (LOG_*), and by the benchmarks (BENCH_DIR).
OTHER_VARIABLES = {
    f"{ENV_PREFIX}URL": "daemon URL for client commands and the engine (default: from HOST/PORT)",
    f"{ENV_PREFIX}LOG_LEVEL": "--log-level",
    f"{ENV_PREFIX}LOG_FORMAT": "--log-format",
    f"{ENV_PREFIX}BENCH_DIR": "where the benchmarks write their demo checkpoints",
}


def env_names(field: str) -> list[str]:
    """The environment variable(s) that set the daemon setting ``field``, preferred first."""
    return [ENV_PREFIX + name for name in ALIASES.get(field, (field.upper(),))]


def known_variables() -> list[str]:
    names = [n for field in SETTINGS_FIELDS for n in env_names(field)]
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
