"""``weight-cache serve``'s options, made from the settings model: one option per field of
:class:`service.settings.DaemonSettings`, with the flag, help and default the field declares and
the variables it reads named in its help. Click only parses (a number, a path, a repeated
value); the settings validate, so a bad value reads the same from a flag or a variable."""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click
from pydantic.fields import FieldInfo

from protocol.setting import Setting, setting_of
from service.settings import DaemonSettings

if TYPE_CHECKING:
    from pydantic import ValidationError

F = TypeVar("F", bound=Callable[..., Any])


def _value_type(annotation: Any) -> tuple[Any, bool]:
    """The type one value of a field has, and whether the option repeats (a list field)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _value_type(args[0])
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return _value_type(args[0])
    if origin is list:
        return args[0], True
    return annotation, False


def repeats(field: FieldInfo) -> bool:
    """Whether a field's option repeats (a list field; its variable takes ``a:b``)."""
    return _value_type(field.annotation)[1]


def _bounds(field: FieldInfo) -> tuple[int | None, int | None]:
    low = next((m.ge for m in field.metadata if getattr(m, "ge", None) is not None), None)
    high = next((m.le for m in field.metadata if getattr(m, "le", None) is not None), None)
    return low, high


def _click_type(value: Any, field: FieldInfo, checked: bool) -> click.ParamType[Any, Any] | None:
    """How click parses one value; ``checked``: and refuses a bad one itself."""
    if value is int:
        return click.IntRange(*_bounds(field)) if checked else click.INT
    if value is float:
        return click.FLOAT
    if typing.get_origin(value) is typing.Literal:
        return click.Choice([str(choice) for choice in typing.get_args(value)])
    if value is Path and checked:
        return click.Path(path_type=Path, exists=True, dir_okay=False)
    return None  # text: the settings parse it (a path, a size, a device, a group; '' stays '')


def option_help(described: Setting, repeats: bool, client: bool = False) -> str:
    """The field's help (a client's, for a client's option) with what --help adds: repeating,
    the default, the variables."""
    text = (described.client_help if client else None) or described.help
    if repeats:
        text += " (repeatable; ':'-separated in the variable)"
    where = []
    if described.shown_default is not None:
        where.append(f"default: {described.shown_default}")
    where.append(f"env: {' or '.join(described.variables)}")
    return f"{text} [{'; '.join(where)}]."


def settings_option(name: str, field: FieldInfo, client: bool = False) -> Callable[[F], F]:
    """The click option of settings field ``name`` (unset: ``None``, so the environment and the
    field's default apply); ``client``: worded for a client of the daemon."""
    described = setting_of(field)
    value, repeats = _value_type(field.annotation)
    help_text = option_help(described, repeats, client)
    if value is bool:
        flag = described.flag.removeprefix("--")
        return click.option(f"--{flag}/--no-{flag}", name, default=None, help=help_text)
    return click.option(
        *described.flags,
        name,
        type=_click_type(value, field, described.checked_by_cli),
        multiple=repeats,
        help=help_text,
    )


def environment_only() -> str:
    """The settings without a flag, for the command's help."""
    lines = [
        f"{' or '.join(described.variables)}: {described.help}."
        for described in map(setting_of, DaemonSettings.model_fields.values())
        if not described.flags
    ]
    return "\b\nSet in the environment only:\n" + "\n".join(f"  {line}" for line in lines)


def settings_options(command: F) -> F:
    """One option per setting that has a flag, in the model's order."""
    fields = DaemonSettings.model_fields
    for name, field in reversed(fields.items()):
        if setting_of(field).flags:
            command = settings_option(name, field)(command)
    return command


def flag_of(field: str) -> str:
    """The flag that sets ``field`` (empty for a setting without one)."""
    return setting_of(DaemonSettings.model_fields[field]).flag


def describe(exc: ValidationError) -> str:
    """A settings error as one line naming the flag and variable to fix."""
    fields = DaemonSettings.model_fields
    by_env = {n: f for f, info in fields.items() for n in setting_of(info).variables}
    parts = []
    for error in exc.errors():
        loc = str(error["loc"][0]) if error["loc"] else ""
        field = by_env.get(loc.upper(), loc)
        if field in fields:
            variables = " or ".join(setting_of(fields[field]).variables)
            names = " / ".join(n for n in (flag_of(field), variables) if n)
        else:
            names = loc or "settings"
        message = str(error["msg"]).removeprefix("Value error, ")
        parts.append(f"{names}: {message}" if loc else message)
    return "; ".join(parts)
