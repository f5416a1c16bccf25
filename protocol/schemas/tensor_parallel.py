"""How far tensor parallelism goes: the one limit every request, setting and query that names a
TP size or rank is held to."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

MAX_TP_SIZE = 64

TpSize = Annotated[int, Field(ge=1, le=MAX_TP_SIZE)]
TpRank = Annotated[int, Field(ge=0, le=MAX_TP_SIZE - 1)]
