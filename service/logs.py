"""One log format for weight-cache and uvicorn, at one level, as text or JSON lines.

JSON lines are written by the standard library (``json`` in a ``logging.Formatter``) rather than
python-json-logger: the records need only a fixed handful of fields, and the engine side, which
installs into vLLM's environment, should not gain a dependency for them. Messages quote request
paths and file names an outsider chooses: control characters in them are escaped, so one record
is always one line and cannot forge another.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, TextIO

from pydantic_settings import BaseSettings, SettingsConfigDict

from protocol.logsafe import escape_controls
from protocol.setting import ENV_PREFIX, setting

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Loggers that would otherwise keep a level or handler of their own.
_FRAMEWORK_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "fastapi")


class LogSettings(BaseSettings):
    """How every ``weight-cache`` command logs (the group's options, a subcommand's too)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="ignore", env_ignore_empty=True, populate_by_name=True
    )

    log_level: str = setting(
        "INFO", flag="--log-level", help="Level of every log line, uvicorn's included"
    )
    log_format: str = setting(
        "text", flag="--log-format", help="text, or json (one object per line)"
    )


class TextFormatter(logging.Formatter):
    """The classic one-line format, with the message's control characters escaped (a traceback,
    appended after it, keeps its lines)."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        message = record.message
        record.message = escape_controls(message)
        try:
            return super().formatMessage(record)
        finally:
            record.message = message


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and the traceback if any."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)  # ASCII: C1 controls escaped too


def configure_logging(level: str = "INFO", fmt: str = "text", stream: TextIO | None = None) -> None:
    """Send every record (ours, uvicorn's, the libraries') through one handler at ``level``."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in _FRAMEWORK_LOGGERS:
        framework = logging.getLogger(name)
        framework.handlers.clear()
        framework.propagate = True
        framework.setLevel(logging.NOTSET)
    # One line per HTTP request a client makes is noise below DEBUG.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, root.level))
    logging.getLogger("httpcore").setLevel(max(logging.WARNING, root.level))
