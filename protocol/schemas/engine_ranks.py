"""How a request names the engine behind it: its process, as the kernel numbers processes, and
the group its TP ranks share. Written once, as every request of an engine's rank (a lease, a
parked engine, a start-up slot, a donation) is held to the same bounds."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

GROUP_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"

ClientPid = Annotated[int, Field(ge=1, le=2**31 - 1)]  # a pid_t above 0
EngineGroup = Annotated[str, Field(pattern=GROUP_PATTERN)]  # its description says what it groups
