"""Route dependencies (async: FastAPI runs sync dependencies in a thread pool, a hop per
request that the lease path cannot afford)."""

from __future__ import annotations

from fastapi import Request

from service.daemon import Daemon


async def get_daemon(request: Request) -> Daemon:
    daemon: Daemon = request.app.state.daemon
    return daemon
