"""The operator's guide's settings table (docs/operating.md), made from the settings models: the
daemon's, then the variables the others read besides (``make settings-table`` rewrites it; a
test fails while the copy there is stale)."""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic.fields import FieldInfo

from protocol.setting import Setting, setting_of
from service.env import other_settings
from service.settings import DaemonSettings
from weight_cache_cli.settings_options import repeats

BEGIN = "<!-- settings table: written by `make settings-table` from service/settings.py -->"
END = "<!-- end of the settings table -->"
SETTINGS_DOC = "docs/operating.md"  # where the table lives


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _code(names: tuple[str, ...] | list[str]) -> str:
    """The first name, and the others in parentheses."""
    first, *others = (f"`{name}`" for name in names)
    return first + (f" ({', '.join(others)})" if others else "")


def _row(field: FieldInfo, described: Setting) -> str:
    if field.annotation is bool:
        flag = f"`{described.flag}`/`--no-{described.flag.removeprefix('--')}`"
    elif described.flags:
        flag = _code(described.flags) + (" (repeatable)" if repeats(field) else "")
    else:
        flag = "-"
    cells = [flag, _code(described.variables), described.shown_default or "none", described.help]
    return f"| {' | '.join(_cell(c) for c in cells)} |"


def table() -> str:
    """The Markdown table: one row per setting of the daemon, then the other models' own."""
    rows = ["| flag | variable | default | meaning |", "| --- | --- | --- | --- |"]
    rows += [_row(field, setting_of(field)) for field in DaemonSettings.model_fields.values()]
    rows += [_row(field, described) for field, described in other_settings()]
    return "\n".join(rows)


def with_table(readme: str) -> str:
    """``readme`` with the text between its markers replaced by :func:`table`."""
    head, begin, rest = readme.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"no {BEGIN!r} ... {END!r} markers in the text")
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def main() -> None:
    """Rewrite the table in the file named on the command line (default: docs/operating.md)."""
    path = Path(sys.argv[1] if len(sys.argv) > 1 else SETTINGS_DOC)
    path.write_text(with_table(path.read_text()))


if __name__ == "__main__":
    main()
