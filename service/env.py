"""The ``WEIGHT_CACHE_*`` variables: every one a settings model reads (the daemon's, the command's
logging, a client's, the benchmarks'), and the rule that refuses any other, so a typo never passes
silently."""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterator, Mapping

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

from protocol.client_settings import BenchSettings, ClientSettings
from protocol.setting import ENV_PREFIX, Setting, setting_of
from service.keeper.settings import KeeperSettings
from service.logs import LogSettings
from service.settings import DaemonSettings

# Every model whose fields read WEIGHT_CACHE_* variables, the daemon's first (the README's order).
SETTINGS_MODELS: tuple[type[BaseSettings], ...] = (
    DaemonSettings,
    LogSettings,
    KeeperSettings,
    ClientSettings,
    BenchSettings,
)


def env_names(field: str) -> list[str]:
    """The environment variable(s) that set the daemon setting ``field``, preferred first."""
    return list(setting_of(DaemonSettings.model_fields[field]).variables)


def other_settings() -> Iterator[tuple[FieldInfo, Setting]]:
    """The fields of the models other than the daemon's that read a variable the daemon does not
    (a client reads the daemon's ``PORT`` as the daemon does: one field, listed once)."""
    seen = {
        n for field in DaemonSettings.model_fields.values() for n in setting_of(field).variables
    }
    for model in SETTINGS_MODELS[1:]:
        for field in model.model_fields.values():
            described = setting_of(field)
            if not seen.issuperset(described.variables):
                seen.update(described.variables)
                yield field, described


def known_variables() -> list[str]:
    return sorted(
        {
            name
            for model in SETTINGS_MODELS
            for field in model.model_fields.values()
            for name in setting_of(field).variables
        }
    )


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
