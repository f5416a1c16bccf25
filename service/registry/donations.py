"""Donated models: an engine's rank as vLLM's own loader and processing left it, given to the
daemon to keep and lend like a model it loaded.

A donation has two steps. The offer (:meth:`Donations.offer`) checks that the caller may write
what other engines will compute with (the daemon's own user or root; a token holder only with
``allow_token_donations``), registers the model by its key's digest (a key held or being
donated is refused: nothing is overwritten), claims its budget and makes its arena; the donor
writes every tensor into it. The commit (:meth:`Donations.commit`) takes the tensors' places
and checksums and the state processing left, checks every byte against its checksum (so a
donor's bytes are checked as a load's are), and publishes the model: from then on it is
leased, kept by the keeper and scrubbed as any other. A pending donation whose donor process
ended is dropped with its arena.

The arena is host shared memory for a donor on the CPU and a shareable allocation on the
donor's GPU for one on a GPU (:mod:`service.registry.donation_arenas`); the handle socket passes
its descriptor to the donor for the offer's secret. Nothing else here knows which.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash

from modelopt_fp8.processing.tensor_spec import TensorSpec
from protocol.checksum import storage_checksum
from protocol.dtypes import to_torch
from protocol.errors import (
    DonationExistsError,
    DonationInvalidError,
    DonationNotAllowedError,
    DonationNotFoundError,
    DonationSecretError,
    InvalidRequestError,
    WeightCacheError,
)
from protocol.logsafe import get_logger
from protocol.processes import process_status
from protocol.schemas.donated import Donated, DonationKey, Donor
from protocol.schemas.donations import (
    DonationCommit,
    DonationInfo,
    DonationOffer,
    DonationRequest,
)
from protocol.schemas.manifest import (
    CheckpointDigests,
    CheckpointIdentity,
    DaemonIdentity,
    Manifest,
    TensorEntry,
)
from protocol.schemas.models import ModelState
from service.memory.arena import Arena
from service.memory.layout import ArenaLayout, pack
from service.metrics import Metrics
from service.registry.donation_arenas import DonationArenas
from service.registry.lease_holders import Caller, Holder, prove_holder, trusted_uids
from service.registry.loader import Progress, ResidentRank
from service.registry.model_table import ModelTable
from service.registry.models import ModelRecord

log = get_logger("service.daemon")

DONATED_PREFIX = "donated-"


def donated_model_id(key: DonationKey) -> str:
    """The id a donated model is held under: its key's digest."""
    return DONATED_PREFIX + key.digest()[:24]


def may_donate(caller: Caller, token_donations: bool) -> bool:
    """Whether ``caller`` may donate: the daemon's own user or root, or a token holder where the
    daemon allows token holders to (never any other local user)."""
    if caller.uid is not None and caller.uid in trusted_uids():
        return True
    return caller.token and token_donations


@dataclass(eq=False)
class Pending:
    """A donation offered and not committed yet."""

    record: ModelRecord
    arena: Arena
    layout: ArenaLayout
    sizes: dict[str, int]  # each tensor's bytes, as offered
    secret: str
    key: DonationKey
    donor: Donor
    holder: Holder  # the donor as proven: the handle socket passes the arena to it alone


def _span_bytes(entry: TensorEntry) -> int:
    """The bytes ``entry``'s shape and stride reach from its storage's start."""
    if any(n == 0 for n in entry.shape):
        return 0
    last = sum((n - 1) * s for n, s in zip(entry.shape, entry.stride, strict=True))
    return (last + 1) * to_torch(entry.dtype).itemsize


@dataclass(eq=False)  # identity: one daemon's donations
class Donations:
    models: ModelTable
    lock: threading.RLock
    token_donations: bool
    daemon: DaemonIdentity
    arenas: DonationArenas
    metrics: Metrics
    pending: dict[str, Pending] = field(default_factory=dict, init=False)

    # --- the offer ----------------------------------------------------------------------------

    def offer(self, req: DonationRequest, caller: Caller) -> DonationOffer:
        """An arena for ``req``'s tensors, registered under its key; refused to a caller that
        may not donate and for a key held or being donated. Unleased donated models may be
        evicted to make room (:mod:`service.registry.eviction`)."""
        try:
            offer = self._offer(req, caller)
        except WeightCacheError as exc:
            self.metrics.donations_refused.labels(code=exc.code).inc()
            raise
        self.metrics.donations_offered.inc()
        return offer

    def _offer(self, req: DonationRequest, caller: Caller) -> DonationOffer:
        if not may_donate(caller, self.token_donations):
            raise DonationNotAllowedError(
                f"uid {caller.uid} may not donate to this daemon", uid=caller.uid
            )
        holder = prove_holder(caller, req.client_pid)  # /proc: outside the lock
        self.drop_abandoned()
        placement = self.arenas.placement(req.key)
        names = [t.name for t in req.tensors]
        if len(set(names)) != len(names):
            raise InvalidRequestError.of_field("tensors", "a tensor is named twice", "value_error")
        layout = pack(
            TensorSpec(t.name, torch.uint8, (t.nbytes,), (t.nbytes,), (1,)) for t in req.tensors
        )
        model_id = donated_model_id(req.key)
        record = ModelRecord(
            id=model_id,
            path=Path(req.key.checkpoint_path),
            tp_size=1,
            progress=Progress(bytes_total=layout.nbytes, tensors_total=len(req.tensors)),
            given_by_engine=True,
        )
        donor = Donor(
            uid=caller.uid,
            pid=holder.pid,
            via=caller.via,
            token=caller.token,
            donated_at=time.time(),
        )
        with self.lock:
            if model_id in self.pending:
                raise DonationExistsError(
                    f"{model_id} is being donated by pid {self.pending[model_id].donor.pid}",
                    model=model_id,
                )
            self.models.add_donated(record, layout.nbytes)
            # Room where the arena goes last: a donation refused for its key or the caps
            # evicts nobody for it.
            try:
                self.arenas.make_room(placement, layout.nbytes, self.models.make_free)
            except WeightCacheError:
                self.models.remove_donated(record)
                raise
        secret = secrets.token_hex(16)
        arena: Arena | None = None
        try:
            arena = self.arenas.allocate(layout, placement, model_id)
            handle = self.arenas.handle(arena, secret)
        except BaseException:
            with self.lock:
                self.models.remove_donated(record)
            if arena is not None:
                arena.release()
            raise
        sizes = {t.name: t.nbytes for t in req.tensors}
        pending = Pending(record, arena, layout, sizes, secret, req.key, donor, holder)
        with self.lock:
            self.pending[model_id] = pending
        log.info(
            "donation %s offered to uid %s pid %s (%d bytes)",
            model_id,
            caller.uid,
            holder.pid,
            layout.nbytes,
        )
        return DonationOffer(
            model=model_id,
            secret=pending.secret,
            handle=handle,
            offsets=layout.offsets,
            nbytes=layout.nbytes,
        )

    # --- the commit ---------------------------------------------------------------------------

    def _take(self, model_id: str, secret: str, caller: Caller) -> Pending:
        """The pending donation ``model_id``, taken out of the table, if ``caller`` holds its
        secret."""
        if not may_donate(caller, self.token_donations):
            raise DonationNotAllowedError(f"uid {caller.uid} may not donate to this daemon")
        with self.lock:
            pending = self.pending.get(model_id)
            if pending is None:
                raise DonationNotFoundError(f"no pending donation {model_id!r}", model=model_id)
            if not secrets.compare_digest(pending.secret, secret):
                raise DonationSecretError(f"donation {model_id} was offered to another caller")
            del self.pending[model_id]
        return pending

    def commit(self, model_id: str, body: DonationCommit, caller: Caller) -> ModelRecord:
        """Check every committed tensor against the arena offered and its checksum, then publish
        the model; any mismatch drops the donation with its arena."""
        try:
            record = self._commit(model_id, body, caller)
        except WeightCacheError as exc:
            self.metrics.donations_refused.labels(code=exc.code).inc()
            raise
        self.metrics.donations_committed.inc()
        return record

    def _commit(self, model_id: str, body: DonationCommit, caller: Caller) -> ModelRecord:
        pending = self._take(model_id, body.secret, caller)
        try:
            entries = _checked_entries(pending, body.tensors)
            manifest = self._manifest(
                pending, entries, Donated(key=pending.key, state=body.state, donor=pending.donor)
            )
            rank = ResidentRank(pending.arena, manifest, self.arenas.digest(pending.arena))
            self.models.publish_donated(pending.record, [rank])
        except BaseException:
            self._drop(pending)
            raise
        log.info(
            "%s donated by uid %s: %d tensors, %d bytes",
            model_id,
            pending.donor.uid,
            len(entries),
            pending.layout.nbytes,
        )
        return pending.record

    def abandon(self, model_id: str, secret: str, caller: Caller) -> None:
        """The donor gives up (its copy failed): the model and its arena go."""
        self._drop(self._take(model_id, secret, caller))
        self.metrics.donations_abandoned.labels(why="donor").inc()

    def _drop(self, pending: Pending) -> None:
        with self.lock:
            self.models.remove_donated(pending.record)
        pending.arena.release()

    def drop_abandoned(self) -> None:
        """Drop every pending donation whose donor process ended, or whose model was unloaded."""
        with self.lock:
            gone = [(p, why) for p in self.pending.values() if (why := self._gone(p)) is not None]
            for p, _ in gone:
                del self.pending[p.record.id]
        for p, why in gone:
            log.warning("donation %s dropped (%s; donor pid %s)", p.record.id, why, p.donor.pid)
            self._drop(p)
            self.metrics.donations_abandoned.labels(why=why).inc()

    def _gone(self, pending: Pending) -> str | None:
        """Why ``pending`` is to be dropped (``unloaded``, ``donor_gone``); None: it stands."""
        if self.models.records.get(pending.record.id) is not pending.record:
            return "unloaded"
        watched = pending.holder.process
        if watched is None:
            return None
        status = process_status(watched[0])
        alive = status is not None and not status.ended and status.start == watched[1]
        return None if alive else "donor_gone"

    def pending_arena(self, model_id: str) -> tuple[Pending, Arena] | None:
        """The pending donation ``model_id`` and its arena, which the handle socket passes to
        its donor alone (call under the lock)."""
        pending = self.pending.get(model_id)
        return None if pending is None else (pending, pending.arena)

    def _manifest(self, pending: Pending, entries: list[TensorEntry], donated: Donated) -> Manifest:
        key = pending.key
        manifest = Manifest(
            model=pending.record.id,
            tp_rank=0,
            tp_size=1,
            daemon=self.daemon,
            device=pending.arena.device,
            checkpoint=CheckpointIdentity(
                path=key.checkpoint_path,
                fingerprint=key.sampled,
                digests=CheckpointDigests(
                    files=key.files, sampled=key.sampled, hf_blob=key.hf_blob, full=None
                ),
                architecture=key.architecture,
                quant_algo=key.quantization or "none",
                kv_cache_quant_algo=None,
            ),
            tensors=entries,
            layers=[],
            donation=donated,
            layout_digest="",
        )
        layout = manifest.model_dump_json(exclude={"layout_digest"}).encode()
        return manifest.model_copy(update={"layout_digest": xxhash.xxh3_128_hexdigest(layout)})

    # --- views ---------------------------------------------------------------------------------

    def infos(self) -> list[DonationInfo]:
        """Every donated model, pending or held."""
        self.drop_abandoned()
        with self.lock:
            out = [
                DonationInfo(model=p.record.id, state=ModelState.loading, key=p.key, donor=p.donor)
                for p in self.pending.values()
            ]
            for record in self.models.records.values():
                donated = record.donated
                if donated is not None and record.state is ModelState.ready:
                    out.append(
                        DonationInfo(
                            model=record.id,
                            state=record.state,
                            key=donated.key,
                            donor=donated.donor,
                        )
                    )
        return out


def _checked_entries(pending: Pending, tensors: list[TensorEntry]) -> list[TensorEntry]:
    """``tensors`` if each is one the offer sized, at its offset, within its bytes, and its
    bytes in the arena match its checksum; else :class:`DonationInvalidError` naming the first
    that does not."""
    offsets = pending.layout.offsets
    names = [t.name for t in tensors]
    if sorted(names) != sorted(offsets):
        missing = sorted(set(offsets) - set(names))
        extra = sorted(set(names) - set(offsets))
        raise DonationInvalidError(
            "the committed tensors are not the ones offered",
            missing=missing[:8],
            unexpected=extra[:8],
        )
    base = pending.arena.base
    sized = pending.sizes
    for entry in tensors:
        if (
            entry.arena != 0
            or entry.offset != offsets[entry.name]
            or entry.nbytes != sized[entry.name]
        ):
            raise DonationInvalidError(
                f"{entry.name} is not where the offer put it", tensor=entry.name
            )
        if _span_bytes(entry) > entry.nbytes or len(entry.shape) != len(entry.stride):
            raise DonationInvalidError(
                f"{entry.name}'s shape and stride reach past its bytes", tensor=entry.name
            )
        got = storage_checksum(base[entry.offset : entry.offset + entry.nbytes])
        if got != entry.checksum:
            raise DonationInvalidError(
                f"{entry.name}'s bytes do not match its checksum",
                tensor=entry.name,
                expected=entry.checksum,
                got=got,
            )
    return tensors
