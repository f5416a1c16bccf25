"""What a donated model is: the key that decides its processed bytes, the state vLLM's
processing left beside the tensors, and who gave it when.

A donated model is one engine's rank after vLLM's own loader and each quantization method's
``process_weights_after_loading``: the daemon did not process it, it keeps and lends it. An
engine attaches only where every field of its own :class:`DonationKey` equals the donor's; this
module imports nothing of the manifest, which carries a :class:`Donated` beside its tensors.
"""

from __future__ import annotations

import json
from typing import ClassVar, Literal

import xxhash
from pydantic import BaseModel, ConfigDict, Field, model_validator

_FROZEN = ConfigDict(frozen=True, extra="forbid")

# The kernel a lease on a donated model names: its bytes are what the donor's vLLM picked
# (``DonationKey.kernels``), not a kernel of the daemon's.
DONATED_KERNEL = "donated"

Plain = str | int | float | bool | None


class DonationKey(BaseModel):
    """Everything that decides the bytes vLLM's processing leaves for one rank: two engines
    whose keys are equal field by field would build the same tensors."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)  # false is not 0

    files: str = Field(description="the checkpoint's files-tier digest (names, sizes, mtimes)")
    sampled: str = Field(description="the checkpoint's sampled-tier digest (the default tier)")
    hf_blob: str | None = Field(description="the Hugging Face blob tier; null outside a cache")
    architecture: str = Field(description="the model class vLLM built")
    vllm_version: str
    torch_version: str
    quantization: str | None = Field(description="vLLM's quantization method; null: none")
    kernels: list[str] = Field(
        description="every quant method and kernel class vLLM picked, sorted, with its count"
    )
    dtype: str = Field(description="the model's dtype as vLLM resolved it")
    kv_cache_dtype: str
    device_kind: Literal["cpu", "cuda"]
    device_name: str = Field(description="the CPU platform, or the GPU's name")
    compute_capability: str | None
    device_uuid: str | None = Field(
        default=None,
        description="the GPU the arena lives on, by UUID (an engine attaches zero-copy only on "
        "that GPU); null on the CPU, whose arena every engine of the host maps",
        max_length=128,
    )
    tp_rank: int = Field(ge=0)
    tp_size: int = Field(ge=1)
    max_model_len: int = Field(description="sizes what constructors build (the rotary cache)")
    checkpoint_path: str = Field(description="where the donor read it (shown, not compared)")

    COMPARED_EXCLUDE: ClassVar[frozenset[str]] = frozenset({"checkpoint_path"})

    @model_validator(mode="after")
    def _names_its_gpu(self) -> DonationKey:
        """A GPU's key names the GPU (its arena goes there); a CPU's names none."""
        if (self.device_kind == "cuda") != (self.device_uuid is not None):
            raise ValueError("device_uuid names the GPU of a cuda key, and only of a cuda key")
        return self

    def compared(self) -> dict[str, object]:
        """The fields two keys must agree on (the path a copy lives at is not one)."""
        return self.model_dump(exclude=set(self.COMPARED_EXCLUDE))

    def digest(self) -> str:
        """xxh3-128 of the compared fields: the donated model's id is made from it."""
        text = json.dumps(self.compared(), sort_keys=True, separators=(",", ":"))
        return xxhash.xxh3_128_hexdigest(text.encode())

    def differences(self, other: DonationKey) -> list[str]:
        """The compared fields whose values differ, in field order."""
        mine, theirs = self.compared(), other.compared()
        return [name for name in mine if mine[name] != theirs[name]]


class PlainAttribute(BaseModel):
    """One attribute vLLM's processing set or changed on a module, its quant method or its
    kernel: plain data, a tuple or list of it, or a torch dtype (by name)."""

    model_config = _FROZEN

    kind: Literal["plain", "tuple", "list", "dtype"]
    value: Plain | list[Plain]


class DonatedTensorRole(BaseModel):
    """How one tensor sits on its module: a parameter (of which class), a buffer, or a plain
    tensor attribute; ``alias_of``: the first name holding the same tensor (a tied head);
    ``on_host``: the donor held it in host memory beside a GPU arena (vLLM keeps host copies of
    attention scales), so an engine copies it back to the host from the arena."""

    model_config = _FROZEN

    name: str
    kind: Literal["param", "buffer", "attr"]
    parameter_class: str | None = Field(default=None, description="the parameter's class name")
    requires_grad: bool = False
    alias_of: str | None = None
    on_host: bool = False


class DonatedState(BaseModel):
    """What an engine sets besides the tensors to equal the donor: where each tensor sits, the
    attributes processing set, and the runtime callables it rebuilds (by name)."""

    model_config = _FROZEN

    roles: list[DonatedTensorRole]
    attributes: dict[str, PlainAttribute] = Field(
        description="'<module>.<attr>', '<module>.quant_method.<attr>', '<module>.kernel.<attr>'"
    )
    runtime: dict[str, str] = Field(
        default_factory=dict,
        description="'<module>.<attr>' set by processing to a callable the engine rebuilds with "
        "vLLM's own code, by the name of what rebuilds it",
    )


class Donor(BaseModel):
    """Who gave a donated model, as the kernel proved it, and when."""

    model_config = _FROZEN

    uid: int | None = Field(description="null for a token holder of unknown uid")
    pid: int | None
    via: str = Field(description="unix, tcp or local")
    token: bool
    donated_at: float = Field(description="unix seconds")


class Donated(BaseModel):
    """The part of a donated model's manifest that says what it is."""

    model_config = _FROZEN

    key: DonationKey
    state: DonatedState
    donor: Donor
