"""Control characters a client put into a path or detail never reach a log line raw."""

from __future__ import annotations

import logging

import pytest

from protocol.logsafe import escape_controls, get_logger


def test_escape_controls() -> None:
    assert escape_controls("a\nb\r\x1b[31m\u2028z") == "a\\nb\\r\\x1b[31m\\u2028z"
    assert escape_controls("plain/path-ü") == "plain/path-ü"


def test_logger_escapes_every_record(caplog: pytest.LogCaptureFixture) -> None:
    log = get_logger("service.test-logsafe")
    with caplog.at_level(logging.INFO, logger="service.test-logsafe"):
        log.info("loading %s", "/models/x\nERROR forged")
    (record,) = caplog.records
    assert record.getMessage() == "loading /models/x\\nERROR forged"
