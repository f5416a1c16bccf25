"""Route dependencies (async: FastAPI runs sync dependencies in a thread pool, a hop per
request that the lease path cannot afford)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from service.daemon import Daemon


async def get_daemon(request: Request) -> Daemon:
    daemon: Daemon = request.app.state.daemon
    return daemon


DaemonDep = Annotated[Daemon, Depends(get_daemon)]
