"""Log lines that say what happened and nothing a client wrote into them.

Paths, model ids and error details can come from clients or from files they control; a newline
in a directory name must not start a forged log line, nor an escape sequence recolour a terminal.
Loggers made by :func:`get_logger` escape every control character in the final message
(``\\n`` becomes the two characters ``\\`` ``n``), whatever handlers the process installs.
"""

from __future__ import annotations

import logging
import re

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def escape_controls(text: str) -> str:
    """``text`` with each control character replaced by its Python escape."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


class EscapeControls(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        escaped = escape_controls(message)
        if escaped != message:
            record.msg, record.args = escaped, None
        return True


def get_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` with control characters escaped in every record it makes."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, EscapeControls) for f in logger.filters):
        logger.addFilter(EscapeControls())
    return logger
