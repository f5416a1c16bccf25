"""Fallback is total: every failure between asking for a lease and a bound model becomes one
typed :class:`~protocol.errors.WeightCacheError` with one :class:`~protocol.reasons.Reason`,
which is logged once, counted, and then either falls back or is raised
(:func:`fall_back_or_raise`, the one place that decides).

Foreign exceptions are mapped where they arise (the HTTP client, opening the arena, rebuilding
views); :func:`as_weight_cache_error` is the catch-all for whatever still escapes (vLLM binding,
a bug), so an engine never dies on its way to an ordinary load.
"""

from __future__ import annotations

import collections
import contextlib
import sys
from collections.abc import Iterator

from protocol.errors import (
    AttachError,
    CarriesReason,
    CheckpointError,
    LeaseNotFoundError,
    WeightCacheError,
)
from protocol.logsafe import get_logger
from protocol.reasons import Reason

log = get_logger(__name__)

# Fallbacks by reason in this process; Prometheus reads them where its client is installed.
FALLBACKS: collections.Counter[str] = collections.Counter()  # keys are Reason members
PROMETHEUS_NAME = "weight_cache_engine_fallbacks"  # exposed as ..._total{reason}
FALLING_BACK = "falling back to vLLM's default loader"  # what an engine does, as logged
OWN_LOAD = "serving its own load"  # what a donated load does that cannot share, as logged
FALLBACK_LOG = "weight-cache: %s (%s): %s"  # the action, the reason, the error's detail


def _export_to_prometheus() -> None:
    """Register a collector that reads :data:`FALLBACKS` at scrape time, where
    ``prometheus_client`` is installed (an engine's vLLM serves its registry)."""
    try:
        from prometheus_client import REGISTRY
        from prometheus_client.core import CounterMetricFamily
        from prometheus_client.registry import Collector
    except ImportError:
        return

    class Fallbacks(Collector):
        def collect(self) -> Iterator[CounterMetricFamily]:
            family = CounterMetricFamily(
                PROMETHEUS_NAME, "Engine loads that fell back to disk, by reason", labels=["reason"]
            )
            for reason, count in sorted(FALLBACKS.items()):
                family.add_metric([Reason(reason).value], count)
            yield family

    try:
        REGISTRY.register(Fallbacks())
    except ValueError:  # this module imported twice under two names: the first one exports
        log.debug("%s is exported already", PROMETHEUS_NAME)


_export_to_prometheus()


def reason_of(error: WeightCacheError) -> Reason:
    """The one reason an error stands for: its own where it carries one (attach, verification,
    a park that ended), else the daemon's error code where it names one, else ``daemon_error``."""
    if isinstance(error, CarriesReason):
        return error.reason
    if isinstance(error, CheckpointError):  # the engine's own copy cannot be read
        return Reason.checkpoint_unreadable
    if isinstance(error, LeaseNotFoundError):
        return Reason.lease_expired
    if "remote_code" in error.extra:  # a code this engine does not know
        return Reason.daemon_error
    return Reason.parse(error.code, Reason.daemon_error)


def as_weight_cache_error(exc: Exception, step: Reason = Reason.internal_error) -> WeightCacheError:
    """Any exception raised while attaching or binding, as a typed error with a reason.

    Typed errors pass through unchanged; anything else becomes an :class:`AttachError` whose
    reason is ``step`` (``bind_failed`` while binding into vLLM, ``internal_error`` where the
    step is unknown), keeping the original as its cause when raised ``from exc``.
    """
    if isinstance(exc, WeightCacheError):
        return exc
    return AttachError(f"{type(exc).__name__}: {exc}", reason=step, exception=type(exc).__name__)


@contextlib.contextmanager
def typed_failures(step: Reason) -> Iterator[None]:
    """Inside the block, any untyped exception is raised as :func:`as_weight_cache_error`'s."""
    try:
        yield
    except WeightCacheError:
        raise
    except Exception as exc:
        raise as_weight_cache_error(exc, step) from exc


def record_fallback(error: WeightCacheError, action: str) -> Reason:
    """Log (once, here), count and return the reason an engine is not attaching."""
    reason = reason_of(error)
    FALLBACKS[reason] += 1
    log.warning(FALLBACK_LOG, action, reason, error.detail)
    return reason


def fall_back_or_raise(exc: Exception, fallback: bool, action: str) -> Reason:
    """The one decision when attaching failed with ``exc``: with ``fallback`` off, raise it as
    a typed error (untyped ones as :func:`as_weight_cache_error`'s, from ``exc``); with it on,
    log, count and return the reason (:func:`record_fallback`), and the caller does ``action``.
    Call it from the ``except`` block that caught ``exc``."""
    error = as_weight_cache_error(exc)
    if fallback:
        return record_fallback(error, action)
    if error is exc:
        raise exc
    raise error from exc


@contextlib.contextmanager
def own_failure_after(reason: Reason) -> Iterator[None]:
    """Around vLLM's own load after a fallback: run it outside the ``except`` that caught why
    attaching failed, so its failure is its own, never chained onto the daemon's error (which
    would have a reader blame the daemon); this adds a last line naming the fallback."""
    try:
        yield
    except Exception as exc:
        if sys.version_info >= (3, 11):  # vLLM 0.33 runs on 3.11 and later
            exc.add_note(
                f"weight-cache had fallen back to vLLM's default loader ({reason}); this error "
                "is that loader's own"
            )
        raise
