"""When the daemon is ready: what ``/ready`` answers, decided in one place.

Ready means an engine started now would find what the daemon was asked to hold:

- at least one model is held (a daemon holding none has nothing to lend);
- no model is loading, whether asked for at start or over the API (an engine would wait or fall
  back);
- no model has failed (its arena lost or corrupted included), unless ``--keep-going``: then
  failed models are listed and do not block, as engines fall back for them.

Anything else is 503 with the reason, the models still loading and the failed ones, so a
readiness probe says why.
"""

from __future__ import annotations

from collections.abc import Iterable

from protocol.schemas.health import Readiness
from protocol.schemas.models import ModelState
from service.registry.models import ModelRecord


def readiness(records: Iterable[ModelRecord], keep_going: bool) -> Readiness:
    """The readiness of a daemon holding ``records`` (read under the daemon's lock)."""
    states: dict[str, ModelState] = {}
    failed: dict[str, str] = {}
    for record in records:
        states[record.id] = record.state
        if record.state is ModelState.failed:
            failed[record.id] = str(record.error) if record.error else "failed"
    waiting = [model for model, state in states.items() if state is ModelState.loading]
    reason = None
    if not states:
        reason = "no model is loaded: load one (POST /v1/models) or start with --model"
    elif waiting:
        reason = f"{len(waiting)} model(s) still loading: {', '.join(waiting)}"
    elif failed and not keep_going:
        reason = (
            f"{len(failed)} model(s) failed: {', '.join(failed)} (unload them, or start with "
            "--keep-going to be ready with failed models)"
        )
    return Readiness(
        ready=reason is None, models=states, waiting=waiting, failed=failed, reason=reason
    )
