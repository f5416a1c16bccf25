"""What the keeper holds for the next daemon: each model's record and its arenas' descriptors,
and the live leases. A model is kept only once every rank's descriptor came; a descriptor it
replaces or lets go of is closed."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from protocol.logsafe import get_logger
from service.keeper.messages import KeptLease, KeptModel
from service.memory.shm import remove_if_held

log = get_logger(__name__)
ArenaKey = tuple[str, int]  # (model id, rank)


class KeeperState:
    """What is held, under one lock: models, their arenas' descriptors, leases."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.models: dict[str, KeptModel] = {}
        self.fds: dict[ArenaKey, int] = {}
        self.pending: dict[ArenaKey, int] = {}  # received, their model not yet put
        self.leases: dict[str, KeptLease] = {}

    def put_fd(self, key: ArenaKey, fd: int) -> None:
        with self.lock:
            old = self.pending.pop(key, None)
            self.pending[key] = fd
        if old is not None:
            os.close(old)

    def put_model(self, model: KeptModel) -> None:
        with self.lock:
            stale = self._drop(model.id)
            taken = {r.rank: self.pending.pop((model.id, r.rank), None) for r in model.arenas}
            missing = [rank for rank, fd in taken.items() if fd is None]
            if not missing:
                self.models[model.id] = model
                self.fds.update({(model.id, r): fd for r, fd in taken.items() if fd is not None})
        for fd in stale + [fd for fd in taken.values() if fd is not None and missing]:
            os.close(fd)
        if missing:
            log.error(
                "model %s came without the descriptors of ranks %s: not kept", model.id, missing
            )

    def drop_model(self, model_id: str) -> None:
        with self.lock:
            stale = self._drop(model_id)
        for fd in stale:
            os.close(fd)

    def _drop(self, model_id: str) -> list[int]:
        self.models.pop(model_id, None)
        keys = [k for k in self.fds if k[0] == model_id]
        return [self.fds.pop(k) for k in keys]

    def clear(self, remove_files: bool = False) -> None:
        """Let go of everything; with ``remove_files`` (no daemon holds them), remove the
        shared-memory files too, as the daemon would on unload."""
        with self.lock:
            files = [
                (Path(a.shm_dir) / a.shm_name, self.fds.get((m.id, a.rank)))
                for m in self.models.values()
                for a in m.arenas
                if a.shm_dir and a.shm_name
            ]
            if remove_files:
                for path, fd in files:
                    if fd is not None:
                        remove_if_held(path, fd)
            fds = [*self.fds.values(), *self.pending.values()]
            self.models, self.fds, self.pending, self.leases = {}, {}, {}, {}
        for fd in fds:
            os.close(fd)
