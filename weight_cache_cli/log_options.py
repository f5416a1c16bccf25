"""``--log-level`` and ``--log-format`` after a subcommand too.

They are options of the ``weight-cache`` group (``weight-cache --log-format json serve``); a
subcommand takes them as well (``serve --log-format json``) and reconfigures logging as soon as
they are parsed, keeping the group's value of the one not given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from protocol.setting import Setting, setting_of
from service.logs import FORMATS, LEVELS, LogSettings, configure_logging

F = TypeVar("F", bound=Callable[..., Any])

# The logging settings, each with its choices: the group's options and the subcommands'.
LOG_OPTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("log_level", LEVELS),
    ("log_format", FORMATS),
)


def _described(name: str) -> tuple[Setting, str]:
    """A logging setting's names and help, and its default."""
    field = LogSettings.model_fields[name]
    return setting_of(field), str(field.default)


def group_log_options(command: F) -> F:
    """``--log-level`` and ``--log-format`` on the group, from their variables or defaults."""
    for name, choices in reversed(LOG_OPTIONS):
        described, default = _described(name)
        command = click.option(
            described.flag,
            envvar=described.variable,
            default=default,
            show_default=True,
            show_envvar=True,
            type=click.Choice(choices, case_sensitive=False),
            help=f"{described.help}.",
        )(command)
    return command


def _reconfigure(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is None:
        return
    group = ctx.parent.params if ctx.parent is not None else {}
    chosen = {name: group.get(name, _described(name)[1]) for name, _ in LOG_OPTIONS}
    ctx.meta.setdefault("weight_cache.log", {}).update({str(param.name): value})
    chosen.update(ctx.meta["weight_cache.log"])
    configure_logging(str(chosen["log_level"]), str(chosen["log_format"]).lower())


def log_options(command: F) -> F:
    """The group's logging options, accepted after the subcommand as well."""
    for name, choices in reversed(LOG_OPTIONS):
        described, _ = _described(name)
        command = click.option(
            described.flag,
            type=click.Choice(choices, case_sensitive=False),
            expose_value=False,
            callback=_reconfigure,
            help=f"{described.help}; also before the command.",
        )(command)
    return command
