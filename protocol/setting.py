"""How an operator gives one setting: its flag, its environment variables, how its default
reads. :func:`setting` declares a field of a settings model together with these, so that the
model is the one place a setting is defined: the daemon's
(:class:`service.settings.DaemonSettings`), a client's
(:class:`protocol.client_settings.ClientSettings`: the engine's loader, the client commands, the
benchmarks), the command's logging (:class:`service.logs.LogSettings`) and the benchmarks'
(:class:`protocol.client_settings.BenchSettings`). The commands' options
(``weight_cache_cli/settings_options.py``), the environment rules (``service/env.py``) and the
settings table of docs/operating.md (``weight_cache_cli/settings_table.py``) are made from
them. It lives in ``protocol`` so that the daemon and the engine side declare their settings
one way.

How to add a setting (nothing else to edit: no list of names, no click option):

1. Add a field to its model (:class:`DaemonSettings` for the daemon's), in the place its option
   should take in ``--help``::

       my_limit: int = setting(8, flag="--my-limit", help="What it does, in a phrase", ge=1)

   The variable is named after the flag (``WEIGHT_CACHE_MY_LIMIT``). ``ge``/``le``/``gt``,
   ``default_factory`` and the other :func:`pydantic.Field` keywords pass through;
   ``also=("--other-spelling",)`` adds flag spellings; ``older=("OLD_NAME",)`` keeps reading a
   renamed variable (without the prefix); ``shown="..."`` words a default that reads better
   than its value (``cores - 1``); ``variable="NAME"`` instead of ``flag`` declares one set in
   the environment only; ``checked_by_cli=True`` lets the command refuse a bad value as it
   parses it (a number out of range, a file that does not exist); ``client_help="..."`` says what
   a client does with a daemon's setting it reads too (``--uds``: where it connects). A ``bool``
   field becomes ``--my-flag/--no-my-flag``, a ``list`` field a repeatable option.
2. Run ``make settings-table`` to rewrite the settings table of docs/operating.md
   (``tests/service/test_settings.py`` fails while it is stale).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import AliasChoices, Field
from pydantic_core import PydanticUndefined

if TYPE_CHECKING:
    from pydantic.config import JsonDict
    from pydantic.fields import FieldInfo

ENV_PREFIX = "WEIGHT_CACHE_"


def variable_of(flag: str) -> str:
    """The variable named after a flag: ``--max-ttl`` is ``WEIGHT_CACHE_MAX_TTL``."""
    return ENV_PREFIX + flag.removeprefix("--").replace("-", "_").upper()


@dataclass(frozen=True)
class Setting:
    """A setting's names and how its default reads, kept on its field (as pydantic's
    ``json_schema_extra``, which also writes them into the model's JSON schema)."""

    flags: tuple[str, ...]  # the first is its name; empty: set in the environment only
    variables: tuple[str, ...]  # preferred first; the others are older spellings, still read
    help: str
    shown_default: str | None  # how --help and the settings table word it; None: none shown
    checked_by_cli: bool  # the command checks the value as it parses it (a range, a file)
    client_help: str | None = None  # what a client does with it, where that reads otherwise

    @property
    def variable(self) -> str:
        """The variable it is set with (older spellings aside)."""
        return self.variables[0]

    def __call__(self, schema: JsonDict) -> None:
        schema["flags"] = list(self.flags)
        schema["env"] = list(self.variables)

    @property
    def flag(self) -> str:
        return self.flags[0] if self.flags else ""


def setting(
    default: Any = PydanticUndefined,
    *,
    flag: str | None = None,
    also: tuple[str, ...] = (),
    variable: str | None = None,
    older: tuple[str, ...] = (),
    help: str,
    shown: str | None = None,
    checked_by_cli: bool = False,
    client_help: str | None = None,
    **field: Any,
) -> Any:
    """A settings field: ``flag`` (and the ``also`` spellings of it) on the command line, the
    variable named after the flag (or ``variable``, for a setting without a flag) and the
    ``older`` variable names, all without the ``WEIGHT_CACHE_`` prefix; ``help`` says what it
    does; ``shown`` words a default that reads better than its value (``cores - 1``). The
    other keywords go to :func:`pydantic.Field` (``default_factory``, ``ge``, ``le``...)."""
    if (flag is None) == (variable is None):
        raise TypeError("a setting has a flag or, set in the environment only, a variable")
    first = variable_of(flag) if flag is not None else ENV_PREFIX + str(variable)
    names = (first, *(ENV_PREFIX + name for name in older))
    if shown is None and default is not PydanticUndefined and default is not None:
        shown = f"{default:g}" if isinstance(default, float) else str(default)
    described = Setting(
        flags=(flag, *also) if flag is not None else (),
        variables=names,
        help=help,
        shown_default=shown,
        checked_by_cli=checked_by_cli,
        client_help=client_help,
    )
    return Field(
        default,
        validation_alias=AliasChoices(*names),
        description=help,
        json_schema_extra=described,
        **field,
    )


def setting_of(field: FieldInfo) -> Setting:
    """The names :func:`setting` gave a field."""
    described = field.json_schema_extra
    if not isinstance(described, Setting):
        raise TypeError("every settings field is declared with protocol.setting.setting()")
    return described
