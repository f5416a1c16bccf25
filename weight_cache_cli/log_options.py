"""``--log-level`` and ``--log-format`` after a subcommand too.

They are options of the ``weight-cache`` group (``weight-cache --log-format json serve``); a
subcommand takes them as well (``serve --log-format json``) and reconfigures logging as soon as
they are parsed, keeping the group's value of the one not given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from service.env import LOG_FORMAT, LOG_LEVEL
from service.logs import FORMATS, LEVELS, configure_logging

F = TypeVar("F", bound=Callable[..., Any])


def _reconfigure(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is None:
        return
    group = ctx.parent.params if ctx.parent is not None else {}
    chosen = {
        "log_level": group.get("log_level", LOG_LEVEL.default),
        "log_format": group.get("log_format", LOG_FORMAT.default),
    }
    ctx.meta.setdefault("weight_cache.log", {}).update({str(param.name): value})
    chosen.update(ctx.meta["weight_cache.log"])
    configure_logging(str(chosen["log_level"]), str(chosen["log_format"]).lower())


def log_options(command: F) -> F:
    """The group's logging options, accepted after the subcommand as well."""
    for variable, choices in ((LOG_FORMAT, FORMATS), (LOG_LEVEL, LEVELS)):
        command = click.option(
            variable.flag,
            type=click.Choice(choices, case_sensitive=False),
            expose_value=False,
            callback=_reconfigure,
            help=f"{variable.help}; also before the command.",
        )(command)
    return command
