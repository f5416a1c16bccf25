"""``/v1/models``: load, inspect and unload models."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Response, status
from fastapi import Path as PathParam
from starlette.concurrency import run_in_threadpool

from protocol.schemas.models import MODEL_ID_PATTERN, LoadModelRequest, ModelInfo
from service.api.problems import problem_responses
from service.api.routes.deps import DaemonDep

router = APIRouter(prefix="/v1/models", tags=["models"], responses=problem_responses(401, 422))
ModelId = Annotated[str, PathParam(pattern=MODEL_ID_PATTERN)]


@router.get("", response_model=list[ModelInfo], summary="Every model and its state")
async def list_models(daemon: DaemonDep) -> list[ModelInfo]:
    return await run_in_threadpool(daemon.list_models)  # stats every arena file: a thread


@router.post(
    "",
    response_model=ModelInfo,
    status_code=status.HTTP_202_ACCEPTED,
    summary="Start loading a checkpoint (returns at once; poll the model for its state)",
    responses=problem_responses(403, 404, 409, 429),
)
async def load_model(body: LoadModelRequest, response: Response, daemon: DaemonDep) -> ModelInfo:
    # Opening and checking the directory is filesystem work: never on the event loop.
    record = await run_in_threadpool(daemon.load, Path(body.path), body.id, body.tp_size)
    response.headers["Location"] = f"/v1/models/{record.id}"
    return await run_in_threadpool(daemon.model_info, record)


@router.get(
    "/{model_id}", response_model=ModelInfo, summary="One model", responses=problem_responses(404)
)
async def get_model(model_id: ModelId, daemon: DaemonDep) -> ModelInfo:
    return await run_in_threadpool(lambda: daemon.model_info(daemon.model(model_id)))


@router.delete(
    "/{model_id}",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Unload a model and free its memory (refused while leases are active)",
    responses=problem_responses(404, 409),
)
async def unload_model(model_id: ModelId, daemon: DaemonDep) -> Response:
    await run_in_threadpool(daemon.unload, model_id)  # freeing gigabytes must not stall others
    return Response(status_code=status.HTTP_204_NO_CONTENT)
