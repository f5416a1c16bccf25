"""The FastAPI application: routers, auth, problem documents, body limit, and the lifespan
that starts loading and runs the lease reaper."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import anyio.to_thread
from fastapi import FastAPI

from protocol.logsafe import get_logger
from protocol.version import __version__
from service.api import problems
from service.api.auth import Authenticate
from service.api.limits import BodySizeLimit, body_limits
from service.api.routes import (
    donations,
    health,
    inventory,
    leases,
    metrics,
    models,
    parking,
    startup_slots,
)
from service.api.waits import Waits
from service.daemon import Daemon
from service.settings import DaemonSettings

log = get_logger(__name__)


async def _every(interval_s: float, work: Callable[[], object], what: str) -> None:
    """Run blocking ``work`` in a worker thread every ``interval_s`` (never on the loop),
    outliving any one failed run."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await anyio.to_thread.run_sync(work)
        except Exception:
            log.exception("%s failed", what)


def create_app(settings: DaemonSettings, daemon: Daemon | None = None) -> FastAPI:
    daemon = daemon or Daemon(settings)
    waits = Waits()  # long-polls of parked engines and start-up slots
    daemon.notify_waiting(waits.wake)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        waits.bind(asyncio.get_running_loop())
        await anyio.to_thread.run_sync(daemon.start)  # cleanup and directory work: a thread
        tasks = [
            asyncio.create_task(_every(interval_s, work, what))
            for interval_s, work, what in daemon.periodic_tasks()
        ]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            daemon.shutdown()

    app = FastAPI(
        title="weight-cache",
        version=__version__,
        summary="Processed ModelOpt FP8 weights, resident on the GPU, lent to vLLM engines.",
        lifespan=lifespan,
        # The contract is openapi.json (and `weight-cache openapi`); no unauthenticated pages.
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.daemon = daemon
    app.state.waits = waits
    problems.install(app)
    app.include_router(health.router)
    routers = (
        inventory.router,
        models.router,
        donations.router,
        leases.router,
        parking.router,
        startup_slots.router,
        metrics.router,
    )
    for router in routers:  # the Authenticate middleware guards every route but /health, /ready
        app.include_router(router)
    app.add_middleware(
        BodySizeLimit,
        max_bytes=body_limits(settings, donations.router.prefix),
        on_refuse=daemon.count_refusal,
    )
    # Added last, so it runs first: who may call is decided before a body is read.
    app.add_middleware(
        Authenticate,
        token=lambda: daemon.token,
        trust_local_users=settings.trust_local_users,
        on_refuse=daemon.count_refusal,
    )
    return app
