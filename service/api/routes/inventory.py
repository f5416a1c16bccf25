"""``/v1/inventory``: devices, memory held, and every model."""

from __future__ import annotations

from fastapi import APIRouter

from protocol.schemas.inventory import Inventory
from service.api.problems import problem_responses
from service.api.routes.deps import DaemonDep

router = APIRouter(prefix="/v1", tags=["inventory"], responses=problem_responses(401))


@router.get("/inventory", response_model=Inventory, summary="Devices, cache memory and models")
def inventory(daemon: DaemonDep) -> Inventory:
    return daemon.inventory()  # a plain function: its statvfs runs in a worker thread
