"""A failed model keeps its error, and nothing the failed load had built: not the traceback's
frames (a hostile checkpoint's parsed headers, say), nor the errors it chained to."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

from protocol.errors import InvalidConfigError
from protocol.schemas.models import ModelState
from service.registry.models import ModelRecord


class Parsed:
    """Stands for what a load builds before it fails."""


def _failing_load() -> None:
    parsed = Parsed()  # noqa: F841 - held by this frame, as a load's locals are
    try:
        raise KeyError("inner")
    except KeyError as exc:
        raise InvalidConfigError("the config lies") from exc


def test_a_failed_record_holds_no_frame_of_its_load() -> None:
    record = ModelRecord(id="m", path=Path("/x"), tp_size=1)
    try:
        _failing_load()
    except InvalidConfigError as exc:
        frame_locals = exc.__traceback__.tb_next.tb_frame.f_locals  # type: ignore[union-attr]
        held = weakref.ref(frame_locals["parsed"])
        del frame_locals
        record.fail(exc)
    gc.collect()
    assert record.state is ModelState.failed and record.error is not None
    assert record.error.code == "invalid_config" and record.error.detail == "the config lies"
    assert record.error.__traceback__ is None and record.error.__cause__ is None
    assert held() is None
