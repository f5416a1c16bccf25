"""Whether a lease request fits what a model was processed for. Every model here is processed
once, for one kernel, format and TP size; an engine that would build anything else must not be
handed these bytes, so the request is refused with what differs rather than served."""

from __future__ import annotations

from typing import Any

from protocol.errors import InvalidRequestError, LayoutMismatchError
from protocol.schemas.donated import DONATED_KERNEL
from protocol.schemas.layout import Kernel, WeightFormat
from protocol.schemas.leases import LeaseRequest
from service.registry.models import ModelRecord

# What every model here was processed for; a lease asking for anything else is refused.
SERVED_KERNEL = Kernel.cutlass
SERVED_FORMAT = WeightFormat.default


def check_request_fits(record: ModelRecord, req: LeaseRequest) -> None:
    """Raise :class:`LayoutMismatchError` naming every field (kernel, format, TP size) the
    request asks differently from what ``record`` was processed for, and
    :class:`InvalidRequestError` for a TP rank outside its TP size."""
    mismatches: dict[str, dict[str, Any]] = {}
    # A donated model serves what its donor's vLLM picked, named in its key.
    kernel = DONATED_KERNEL if record.donated is not None else SERVED_KERNEL.value
    for name, asked, served in (
        ("kernel", req.kernel, kernel),
        ("format", req.format, SERVED_FORMAT.value),
        ("tp_size", req.tp_size, record.tp_size),
    ):
        if asked != served:
            mismatches[name] = {"requested": asked, "served": served}
    if mismatches:
        raise LayoutMismatchError(
            f"requested {', '.join(mismatches)} differ from what {req.model!r} was processed for",
            model=req.model,
            mismatches=mismatches,
        )
    if req.tp_rank >= record.tp_size:
        detail = f"tp_rank {req.tp_rank} is outside the model's tp_size {record.tp_size}"
        raise InvalidRequestError.of_field("tp_rank", detail, "out_of_range")
