"""The routes of a registration its caller holds and waits on (a parked engine, a start-up slot
ticket): create one (201, its ``Location``), list the caller's, read one with ``wait_s`` (a
long-poll that answers as soon as its wait is over and holds no worker thread meanwhile), and
remove one.

Both resources answer alike, so one builder adds these routes to each router; only their
names, summaries, models and the desk's methods differ. No ``from __future__ import
annotations`` here: FastAPI reads the endpoints' annotations, and the request body's type and
the path parameter's name (``parked_id``, ``ticket_id``) are the resource's own, so they are
set when the endpoint is made."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Generic, Protocol, TypeVar

from fastapi import APIRouter, Query, Response, status
from fastapi import Path as PathParam
from pydantic import BaseModel

from protocol.schemas.parking import MAX_WAIT_S
from service.api.problems import problem_responses
from service.api.routes.deps import (
    REGISTRATION_ID_PATTERN,
    CallerDep,
    DaemonDep,
    WaitsDep,
    no_content,
)
from service.registry.lease_desk import LeaseDesk
from service.registry.lease_holders import Caller


class Registered(Protocol):
    @property
    def id(self) -> str: ...


T = TypeVar("T", bound=Registered)
Req = TypeVar("Req", bound=BaseModel)


@dataclass(frozen=True)
class RegistrationRoutes(Generic[Req, T]):
    """What one registration resource names and calls. ``names`` are the routes' (and so their
    OpenAPI operations') names: create, list, get, remove; ``summaries`` likewise."""

    request: type[Req]
    model: type[T]
    id_name: str  # the path parameter: ``/{id_name}``
    names: tuple[str, str, str, str]
    summaries: tuple[str, str, str, str]
    create_errors: tuple[int, ...]
    wait_description: str
    create: Callable[[LeaseDesk, Req, Caller], T]
    listed: Callable[[LeaseDesk, Caller], list[T]]
    read: Callable[[LeaseDesk, str, Caller, float], T]
    done: Callable[[T], bool]  # the long-poll answers once this holds
    remove: Callable[[LeaseDesk, str, Caller], None]

    def add_to(self, router: APIRouter) -> None:
        """Add ``POST ""``, ``GET ""``, ``GET /{id}`` and ``DELETE /{id}`` to ``router``."""
        create_name, list_name, get_name, remove_name = self.names
        create_summary, list_summary, get_summary, remove_summary = self.summaries
        request: Any = self.request  # types made at run time, for FastAPI to read
        model: Any = self.model
        id_param = PathParam(alias=self.id_name, pattern=REGISTRATION_ID_PATTERN)
        wait_param = Query(ge=0, le=MAX_WAIT_S, description=self.wait_description)
        one = f"/{{{self.id_name}}}"
        on_one: dict[str, Any] = {"responses": problem_responses(404, 409), "path": one}

        @router.post(
            "",
            name=create_name,
            response_model=self.model,
            status_code=status.HTTP_201_CREATED,
            summary=create_summary,
            responses=problem_responses(*self.create_errors),
        )
        def create(body: request, response: Response, daemon: DaemonDep, caller: CallerDep) -> T:
            made = self.create(daemon.desk, body, caller)
            response.headers["Location"] = f"{router.prefix}/{made.id}"
            return made

        @router.get("", name=list_name, response_model=list[model], summary=list_summary)
        def listed(daemon: DaemonDep, caller: CallerDep) -> list[T]:
            return self.listed(daemon.desk, caller)

        @router.get(**on_one, name=get_name, response_model=self.model, summary=get_summary)
        async def get_one(
            registration_id: Annotated[str, id_param],
            daemon: DaemonDep,
            waits: WaitsDep,
            caller: CallerDep,
            wait_s: Annotated[float, wait_param] = 0.0,
        ) -> T:
            def read() -> T:
                return self.read(daemon.desk, registration_id, caller, wait_s)

            return await waits.until(registration_id, read, self.done, wait_s)

        gone = status.HTTP_204_NO_CONTENT

        @router.delete(**on_one, name=remove_name, status_code=gone, summary=remove_summary)
        def remove(
            registration_id: Annotated[str, id_param], daemon: DaemonDep, caller: CallerDep
        ) -> Response:
            self.remove(daemon.desk, registration_id, caller)
            return no_content()
