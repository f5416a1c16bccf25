"""What lets the daemon's arenas outlive its process, wired for the daemon: the handle socket
that passes descriptors to lease holders, the keeper link, and the adoption at start.

The daemon tells it what happens (a model ready or gone, a lease granted or ended) and asks it
for a lease's handle access; the daemon's own code stays the same with the keeper off.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from protocol.errors import HandleRefusedError
from protocol.logsafe import get_logger
from protocol.schemas.inventory import KeeperInfo
from protocol.schemas.manifest import HandleAccess
from protocol.schemas.models import ModelState
from service.keeper.adopt import adopt_models
from service.keeper.link import KeeperLink
from service.keeper.messages import KeptLease, KeptModel
from service.keeper.records import keepable, kept_lease, kept_model, lease_from_kept
from service.memory.arena import Arena, VmmArena
from service.memory.shm import ArenaDir, group_id
from service.registry.handle_access import Claim
from service.registry.handle_server import HandleServer
from service.registry.leases import Lease, LeaseTable
from service.registry.model_table import ModelTable
from service.registry.models import ModelRecord
from service.run_dir import HANDLE_SOCKET, prepare_run_dir
from service.settings import DaemonSettings

log = get_logger("service.daemon")

# A pending donation by its model id: what the handle socket checks its donor against, and its
# arena (None: no donation pending by that id).
PendingArenas = Callable[[str], tuple[Claim, Arena] | None]


class Custody:
    def __init__(
        self,
        settings: DaemonSettings,
        boot_id: str,
        lock: threading.RLock,
        count_refusal: Callable[[str], None],
    ) -> None:
        self.run_dir = Path(settings.run_dir)
        self.gid = group_id(settings.shm_group)
        self.lock = lock
        # The registry's tables it keeps and adopts into, given at start: they tell it of their
        # changes (constructor arguments), so they are built after it.
        self._tables: tuple[ModelTable, LeaseTable] | None = None
        self._donations: PendingArenas = lambda model_id: None
        self.keeper = KeeperLink(
            self.run_dir, settings.keeper, boot_id, self._holdings, settings.shm_group
        )
        self.handles = HandleServer(
            self.run_dir / HANDLE_SOCKET, self._descriptor, count_refusal, self.gid
        )
        self._serving = False
        self.adopted: dict[str, tuple[Path, int]] = {}  # model id -> (path, tp size)
        self.leases_taken_over = 0  # at start, from the keeper

    # --- lifecycle -----------------------------------------------------------------------------

    @property
    def tables(self) -> tuple[ModelTable, LeaseTable]:
        if self._tables is None:
            raise RuntimeError("custody is not started")
        return self._tables

    def start(
        self,
        arena_dir: ArenaDir | None,
        models: ModelTable,
        leases: LeaseTable,
        donations: PendingArenas = lambda model_id: None,
    ) -> None:
        """Serve descriptors (of leases, and of ``donations`` pending to their donors), attach
        to the keeper, and take over what it held into ``models`` and ``leases`` (before the
        start-up sweep of dead daemons' files, which leaves the keeper's alone)."""
        self._tables = (models, leases)
        self._donations = donations
        prepare_run_dir(self.run_dir, self.gid)
        self.handles.start()
        self._serving = True
        if not self.keeper.enabled:
            return
        start = time.monotonic()
        self.keeper.connect()
        snapshot, fds = self.keeper.take_snapshot()
        self.keeper.start_journal()
        records = adopt_models(snapshot, fds, arena_dir, self.keeper.drop_model)
        if any(isinstance(r.arena, VmmArena) for record in records for r in record.ranks):
            torch.cuda.empty_cache()  # the digests' scratch: the footprint stays the arenas
        now = leases.now()
        with self.lock:
            for record in records:
                models.records[record.id] = record
                self.adopted[record.id] = (record.path, record.tp_size)
            taken = 0
            for kept in snapshot.leases:
                if kept.model in self.adopted:
                    leases.adopt(lease_from_kept(kept), now)
                    taken += 1
                else:
                    self.keeper.drop_lease(kept.id)
            self.leases_taken_over = taken
        if snapshot.models:
            log.info(
                "took over %d of %d model(s) and %d lease(s) from the keeper in %.3f s",
                len(records),
                len(snapshot.models),
                taken,
                time.monotonic() - start,
            )

    def adopted_as(self, model_id: str, path: Path, tp_size: int) -> bool:
        """Whether start-up model ``model_id`` was taken over as asked (then it is not loaded)."""
        return self.adopted.get(model_id) == (Path(path), tp_size)

    @property
    def keeps(self) -> bool:
        """Whether a keeper holds the arenas when this daemon stops (then it leaves them)."""
        return self.keeper.enabled

    def keeper_info(self) -> KeeperInfo:
        """The keeper as the inventory shows it."""
        link = self.keeper
        return KeeperInfo(
            mode=link.mode,
            socket=str(link.path) if link.enabled else None,
            attached=link.attached,
            pid=link.pid if link.enabled else None,
            started_by_daemon=link.started,
        )

    def shutdown(self) -> None:
        self.handles.stop()
        self.keeper.close()

    # --- what happens --------------------------------------------------------------------------

    def access(self, lease: Lease) -> HandleAccess | None:
        """What a lease's holder presents to the handle socket (None if it is not served)."""
        return self.access_for(lease.secret)

    def access_for(self, secret: str) -> HandleAccess | None:
        """What the holder of ``secret`` (a lease's, a pending donation's) presents to the
        handle socket (None if it is not served)."""
        if not self._serving:
            return None
        return HandleAccess(socket=str(self.run_dir / HANDLE_SOCKET), secret=secret)

    def model_ready(self, record: ModelRecord) -> None:
        """Keep ``record``, the one held (told under the lock, so that an unload racing it is
        journaled after it)."""
        if self.keeper.enabled and keepable(record):
            model, fds = kept_model(record)
            self.keeper.put_model(model, fds)

    def model_gone(self, record: ModelRecord) -> None:
        """A model unloaded or failed (call under the daemon's lock): the keeper lets it go."""
        self.adopted.pop(record.id, None)
        self.keeper.drop_model(record.id)

    def lease_granted(self, lease: Lease) -> None:
        self.keeper.put_lease(kept_lease(lease))

    def lease_ended(self, lease: Lease) -> None:
        self.keeper.drop_lease(lease.id)

    # --- for the handle socket and the keeper ----------------------------------------------------

    def _descriptor(self, lease_id: str, arena: int) -> tuple[Claim, int, int]:
        """The live lease (or the pending donation, for its donor to write), a new descriptor
        of its arena (the caller closes it) and the bytes to map; a typed error when there is
        none."""
        models, leases = self.tables
        with self.lock:
            pending = self._donations(lease_id)
            if pending is not None:
                claim, held = pending
                named, opened = lease_id, held.donor_fd
            else:
                lease = leases.get(lease_id, leases.now())
                record = models.get(lease.model)
                if record.state is not ModelState.ready:
                    raise HandleRefusedError(f"model {lease.model} has no arena {arena} to pass")
                claim, held = lease, record.ranks[lease.tp_rank].arena
                named, opened = lease.model, held.engine_fd
            if arena != 0:
                raise HandleRefusedError(f"model {named} has no arena {arena} to pass")
            try:
                fd = opened()
            except OSError as exc:
                raise HandleRefusedError(f"the arena of {named} is gone: {exc}") from exc
            if fd is None:
                raise HandleRefusedError(
                    f"the arena of {named} is lent over legacy CUDA IPC, not as a descriptor"
                )
            size = held.allocation_size if isinstance(held, VmmArena) else held.nbytes
            return claim, fd, size

    def _holdings(self) -> tuple[list[tuple[KeptModel, list[int]]], list[KeptLease]]:
        held, leases = self.tables
        with self.lock:
            models = [
                kept_model(record)
                for record in held.records.values()
                if record.state is ModelState.ready and keepable(record)
            ]
            kept = [kept_lease(lease) for lease in leases.active.values()]
        return models, kept
