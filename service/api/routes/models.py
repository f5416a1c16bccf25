"""``/v1/models``: load, inspect and unload models.

The routes are plain functions, which FastAPI runs in its worker threads: opening a checkpoint,
statting arena files and freeing gigabytes never stall the event loop."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Response, status

from protocol.schemas.models import LoadModelRequest, ModelInfo
from service.api.problems import problem_responses
from service.api.routes.deps import DaemonDep, ModelId, no_content

router = APIRouter(prefix="/v1/models", tags=["models"], responses=problem_responses(401, 422))


@router.get("", response_model=list[ModelInfo], summary="Every model and its state")
def list_models(daemon: DaemonDep) -> list[ModelInfo]:
    return daemon.list_models()


@router.post(
    "",
    response_model=ModelInfo,
    status_code=status.HTTP_202_ACCEPTED,
    summary="Start loading a checkpoint (returns at once; poll the model for its state)",
    responses=problem_responses(403, 404, 409, 429),
)
def load_model(body: LoadModelRequest, response: Response, daemon: DaemonDep) -> ModelInfo:
    record = daemon.load(Path(body.path), body.id, body.tp_size)
    response.headers["Location"] = f"/v1/models/{record.id}"
    return daemon.model_info(record)


@router.get(
    "/{model_id}", response_model=ModelInfo, summary="One model", responses=problem_responses(404)
)
def get_model(model_id: ModelId, daemon: DaemonDep) -> ModelInfo:
    return daemon.model_info(daemon.model(model_id))


@router.delete(
    "/{model_id}",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Unload a model and free its memory (refused while leases are active)",
    responses=problem_responses(404, 409),
)
def unload_model(model_id: ModelId, daemon: DaemonDep) -> Response:
    daemon.unload(model_id)
    return no_content()
