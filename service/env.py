"""The ``WEIGHT_CACHE_*`` variables: those the daemon's settings read (from
:class:`service.settings.DaemonSettings` itself) and the few read elsewhere, and the rule that
refuses any other, so a typo never passes silently."""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass

from service.setting import ENV_PREFIX, setting_of
from service.settings import DaemonSettings


@dataclass(frozen=True)
class Variable:
    """A variable read outside the daemon's settings, as the settings table of docs/operating.md
    lists it."""

    name: str
    flag: str  # the option it stands for, if any
    default: str
    help: str


# Read by the ``weight-cache`` command itself (its --log-* options and keeper's --idle-timeout
# take them as their envvar), by every client command and the engine loader (URL; the clients
# also read the daemon's HOST, PORT, UDS, TOKEN and TOKEN_FILE), and by the benchmarks
# (BENCH_DIR).
LOG_LEVEL = Variable(
    f"{ENV_PREFIX}LOG_LEVEL",
    "--log-level",
    "INFO",
    "Level of every log line, uvicorn's included",
)
LOG_FORMAT = Variable(
    f"{ENV_PREFIX}LOG_FORMAT",
    "--log-format",
    "text",
    "text, or json (one object per line)",
)
KEEPER_IDLE_TIMEOUT = Variable(
    f"{ENV_PREFIX}KEEPER_IDLE_TIMEOUT",
    "--idle-timeout",
    "600",
    "Seconds a keeper (`weight-cache keeper`, or the one serve --keeper auto starts) waits "
    "without a daemon before it lets go of everything and exits (0: never)",
)
OTHER_VARIABLES = (
    LOG_LEVEL,
    LOG_FORMAT,
    KEEPER_IDLE_TIMEOUT,
    Variable(
        f"{ENV_PREFIX}URL",
        "--url",
        f"from {ENV_PREFIX}HOST/{ENV_PREFIX}PORT",
        "Where client commands (status, attach) and the engine find the daemon",
    ),
    Variable(
        f"{ENV_PREFIX}BENCH_DIR",
        "",
        "~/.cache/weight-cache/bench",
        "Where the benchmarks write their demo checkpoints",
    ),
)


def env_names(field: str) -> list[str]:
    """The environment variable(s) that set the daemon setting ``field``, preferred first."""
    return list(setting_of(DaemonSettings.model_fields[field]).variables)


def known_variables() -> list[str]:
    names = [n for field in DaemonSettings.model_fields for n in env_names(field)]
    return sorted({*names, *(v.name for v in OTHER_VARIABLES)})


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
