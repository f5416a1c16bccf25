"""uvicorn's configuration for the daemon's app behind the guarded protocol."""

from __future__ import annotations

from typing import Any

import uvicorn
from fastapi import FastAPI

from service.api.front.limits import KEEP_ALIVE_S, FrontLimits
from service.api.front.uvicorn_protocol import Front, check_uvicorn_version, protocol_for
from service.daemon import Daemon
from service.settings import DaemonSettings


def front_limits(daemon: Daemon, settings: DaemonSettings) -> FrontLimits:
    """The front's limits from ``settings``; the token and the refusal counter are the
    daemon's."""
    return FrontLimits(
        max_connections=settings.max_connections,
        max_header_bytes=settings.max_header_bytes,
        request_timeout_s=settings.request_timeout_s,
        requests_per_caller=settings.requests_per_caller,
        token=lambda: daemon.token,
        on_refuse=daemon.count_refusal,
    )


def server_config(app: FastAPI, settings: DaemonSettings, **extra: Any) -> uvicorn.Config:
    """uvicorn's configuration for ``app``: its address, the guarded protocol, no access log,
    no WebSocket (the daemon serves none), ``KEEP_ALIVE_S`` for idle keep-alive connections,
    and the request timeout for connections still open at shutdown."""
    check_uvicorn_version()
    where: dict[str, Any] = (
        {"uds": str(settings.uds)}
        if settings.uds
        else {"host": settings.host, "port": settings.port}
    )
    options: dict[str, Any] = {"log_level": "info", "access_log": False, **where, **extra}
    return uvicorn.Config(
        app,
        http=protocol_for(Front(front_limits(app.state.daemon, settings))),
        ws="none",
        timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=max(1, round(settings.request_timeout_s)),
        **options,
    )
