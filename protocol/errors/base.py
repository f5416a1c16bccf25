"""The base of every error, and the registry of codes that turns a problem document back into
its class."""

from __future__ import annotations

import enum
from typing import Any, ClassVar

from protocol.reasons import Reason
from protocol.schemas.text import printable_tree

_REGISTRY: dict[str, type[WeightCacheError]] = {}


class WeightCacheError(Exception):
    """Base of every error weight-cache raises on purpose; as such, an unexpected failure."""

    code: ClassVar[str] = "internal_error"
    status: ClassVar[int] = 500
    title: ClassVar[str] = "Internal error"
    # What to do about it: the problem document's ``hint``, the CLI's advice and the last column
    # of the troubleshooting table of docs/operating.md. ``cli_hint``: the same advice for a user
    # of the ``weight-cache`` command, where it differs.
    hint: ClassVar[str] = "report it with the daemon's log, which holds the traceback"
    cli_hint: ClassVar[str] = ""

    def __init__(self, detail: str, **extra: Any) -> None:
        """``extra``: JSON-serialisable context (file, tensor, mismatching fields, a ``reason``).
        An enum (a :class:`~protocol.reasons.Reason`, say) is kept as its value, as the wire
        carries it."""
        super().__init__(detail)
        self.detail = detail
        self.extra: dict[str, Any] = {
            k: v.value if isinstance(v, enum.Enum) else v for k, v in extra.items() if v is not None
        }

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "code" in cls.__dict__:
            _REGISTRY[cls.code] = cls

    def __str__(self) -> str:
        context = ", ".join(f"{k}={v}" for k, v in self.extra.items() if k != "reason")
        return f"[{self.code}] {self.detail}" + (f" ({context})" if context else "")

    def explain(self, cli: bool = False) -> str:
        """One line for an operator: the error and what to do; ``cli`` words the advice for a
        user of the ``weight-cache`` command rather than of the HTTP API."""
        hint = (self.cli_hint if cli else "") or self.hint
        return f"{self}: {hint}" if hint else str(self)

    def problem_fields(self) -> dict[str, Any]:
        """The body of the problem document, before the schema wraps it: every string in it
        printable (a path's odd bytes escaped), so every carrier of it serialises."""
        fields: dict[str, Any] = printable_tree(
            {
                "type": f"urn:weight-cache:problem:{self.code}",
                "title": self.title,
                "status": self.status,
                "detail": self.detail,
                "code": self.code,
                **({"hint": self.hint} if self.hint else {}),
                **self.extra,
            }
        )
        return fields


_REGISTRY[WeightCacheError.code] = WeightCacheError


class CarriesReason(WeightCacheError):
    """An error that names its own fallback reason (``reason`` in its extra fields, else its
    code where that is a reason, as ``bad_response``, else its class's default): the engine
    reports that reason as it is."""

    default_reason: ClassVar[Reason] = Reason.internal_error

    @property
    def reason(self) -> Reason:
        return Reason.parse(self.extra.get("reason", self.code), self.default_reason)


def error_classes() -> dict[str, type[WeightCacheError]]:
    """Every error class by its code."""
    return dict(_REGISTRY)


def error_from_problem(body: dict[str, Any], status: int) -> WeightCacheError:
    """Rebuild the typed error a daemon reported; unknown codes keep their text."""
    code = str(body.get("code", ""))
    cls = _REGISTRY.get(code)
    detail = str(body.get("detail") or body.get("title") or f"HTTP {status}")
    reserved = {"type", "title", "status", "detail", "code", "hint"}
    extra = {k: v for k, v in body.items() if k not in reserved}
    if cls is None:
        return WeightCacheError(detail, http_status=status, remote_code=code or None, **extra)
    return cls(detail, **extra)
