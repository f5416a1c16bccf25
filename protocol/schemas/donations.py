"""Donation requests and answers: an engine asks the daemon for an arena sized for every
tensor of its rank, writes them in, and commits them with their checksums and the state vLLM's
processing left (``protocol/schemas/donated.py``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from protocol.schemas.donated import DonatedState, DonationKey, Donor
from protocol.schemas.engine_ranks import ClientPid
from protocol.schemas.layout import WireDType
from protocol.schemas.manifest import ArenaHandle, TensorEntry
from protocol.schemas.models import ModelState

MAX_DONATED_TENSORS = 65_536
_NAME = Field(min_length=1, max_length=512)


class DonatedTensorSpec(BaseModel):
    """One tensor's storage span the donor will write: ``nbytes`` from its first element to its
    last, as its strides lay it out."""

    model_config = ConfigDict(extra="forbid")

    name: str = _NAME
    dtype: WireDType
    nbytes: StrictInt = Field(ge=0, le=2**40)


class DonationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    key: DonationKey
    tensors: list[DonatedTensorSpec] = Field(min_length=1, max_length=MAX_DONATED_TENSORS)
    client_pid: ClientPid = Field(strict=True)  # this model is not strict as a whole


class DonationOffer(BaseModel):
    """Where to write: the arena (a shared-memory file the donor opens read-write; on a GPU a
    shareable allocation whose descriptor the handle socket passes for ``secret``) and each
    tensor's offset in it."""

    model: str = Field(description="the donated model's id, made from its key's digest")
    secret: str = Field(description="presented with the commit: only this donor commits")
    handle: ArenaHandle
    offsets: dict[str, int]
    nbytes: int


class DonationCommit(BaseModel):
    model_config = ConfigDict(extra="forbid")

    secret: str = Field(min_length=1, max_length=128)
    tensors: list[TensorEntry] = Field(min_length=1, max_length=MAX_DONATED_TENSORS)
    state: DonatedState


class DonationAbandon(BaseModel):
    model_config = ConfigDict(extra="forbid")

    secret: str = Field(min_length=1, max_length=128)


class DonationInfo(BaseModel):
    """A donated model, pending or held: its key, who gave it and when."""

    model: str
    state: ModelState
    key: DonationKey
    donor: Donor
