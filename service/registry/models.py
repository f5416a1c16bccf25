"""A model the daemon was asked to hold: its state, progress, failure and resident ranks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from protocol.devices import Placement
from protocol.errors import ModelFailedError, ModelLoadingError, WeightCacheError
from protocol.schemas.donated import Donated
from protocol.schemas.manifest import CheckpointIdentity
from protocol.schemas.models import LoadProgress, ModelError, ModelInfo, ModelState
from service.registry.loader import Progress, ResidentRank


@dataclass(eq=False)  # identity: a record is one load, however alike two look
class ModelRecord:
    id: str
    path: Path
    tp_size: int
    state: ModelState = ModelState.loading
    progress: Progress = field(default_factory=Progress)
    error: WeightCacheError | None = None
    ranks: list[ResidentRank] = field(default_factory=list)
    checkpoint: CheckpointIdentity | None = None  # known once the checkpoint opened
    started_at: float = field(default_factory=time.monotonic)
    load_seconds: float | None = None
    reserved_bytes: int = 0  # memory budget claimed by this model (its arenas, once planned)
    given_by_engine: bool = False  # donated (from its offer on), not loaded by this daemon
    last_used: float = field(default_factory=time.monotonic)  # its last lease's grant or end

    def touch(self) -> None:
        """A lease on it was granted or ended now (the eviction order's recency)."""
        self.last_used = time.monotonic()

    def holds_on(self, placement: Placement) -> bool:
        """Whether an arena of this model is on ``placement``'s device."""
        return any(
            rank.arena.device.kind is placement.kind and rank.arena.device.index == placement.index
            for rank in self.ranks
        )

    @property
    def donated(self) -> Donated | None:
        """What a donated model is and who gave it (None: a model this daemon loaded)."""
        return self.ranks[0].manifest.donation if self.ranks else None

    @property
    def bytes_resident(self) -> int:
        return sum(rank.arena.nbytes for rank in self.ranks)

    def retry_after_s(self) -> int:
        """A guess at how long the load will take, from its rate so far (at least 1 s)."""
        p = self.progress
        elapsed = time.monotonic() - self.started_at
        if p.bytes_done <= 0 or elapsed <= 0:
            return 1
        remaining = (p.bytes_total - p.bytes_done) * elapsed / p.bytes_done
        return max(1, round(remaining))

    def require_ready(self) -> None:
        """Raise why no lease can be granted on this model yet (still loading: when to retry)
        or at all (failed: the code it failed with)."""
        if self.state is ModelState.loading:
            raise ModelLoadingError(
                f"model {self.id!r} is still loading",
                model=self.id,
                retry_after_s=self.retry_after_s(),
            )
        if self.state is ModelState.failed:
            assert self.error is not None
            raise ModelFailedError(
                f"model {self.id!r} failed to load: {self.error.detail}",
                model=self.id,
                reason=self.error.code,
            )

    def info(self, active_leases: int) -> ModelInfo:
        first = self.ranks[0].manifest if self.ranks else None
        error = None
        if self.error is not None:
            error = ModelError(
                code=self.error.code,
                detail=self.error.detail,
                file=self.error.extra.get("file"),
                tensor=self.error.extra.get("tensor"),
            )
        return ModelInfo(
            id=self.id,
            path=str(self.path),
            state=self.state,
            tp_size=self.tp_size,
            progress=LoadProgress.model_validate(self.progress, from_attributes=True),
            error=error,
            architecture=self.checkpoint.architecture if self.checkpoint else None,
            quant_algo=self.checkpoint.quant_algo if self.checkpoint else None,
            fingerprint=self.checkpoint.fingerprint if self.checkpoint else None,
            digests=self.checkpoint.digests if self.checkpoint else None,
            bytes_resident=self.bytes_resident,
            tensors=len(first.tensors) if first else 0,
            layers=len(first.layers) if first else 0,
            active_leases=active_leases,
            load_seconds=self.load_seconds,
            donor=self.donated.donor if self.donated else None,
        )

    def fail(self, error: WeightCacheError, free_memory: bool = True) -> None:
        """The one way a model fails, whatever failed it (its load, a lost arena, the scrub): no
        lease is granted on it again, and its info and ``/ready`` report ``error``. A load that
        ends so ends now. ``free_memory``: its arenas are released and its budget claim given
        back (engines keep what they mapped); the scrub keeps them, as leases hold them.
        Caller holds the daemon's lock."""
        self.error = _without_frames(error)
        self.state = ModelState.failed
        if self.load_seconds is None:
            self.load_seconds = time.monotonic() - self.started_at
        if free_memory:
            self.release()
            self.reserved_bytes = 0

    def release(self) -> None:
        for rank in self.ranks:
            rank.arena.release()
        self.ranks = []


def _without_frames(error: WeightCacheError) -> WeightCacheError:
    """``error`` as a failed model keeps it: without its traceback and the errors it chains
    to, whose frames hold everything the failed load had built (a hostile checkpoint's parsed
    headers, say) for as long as the model stays listed. The log has the traceback."""
    error.__traceback__ = None
    error.__cause__ = error.__context__ = None
    return error
