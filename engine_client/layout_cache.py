"""Manifests this process already holds, so a lease request can name its layout and the daemon
leave the manifest out of the grant."""

from __future__ import annotations

import collections
import threading

from protocol.errors import VerificationError
from protocol.reasons import Reason
from protocol.schemas.leases import LeaseGrant
from protocol.schemas.manifest import Manifest

__all__ = ["LAYOUTS", "LayoutCache", "LayoutKey"]

LayoutKey = tuple[str, str, int, int]  # (daemon address, model, tp_rank, tp_size)


class LayoutCache:
    """Manifests this process has received, by model and rank. A client names the layout it
    holds (its digest) as ``known_layout``; the daemon then returns only the lease and fresh
    handles, and the grant is completed with the manifest the request named, which the request
    keeps hold of, so an eviction meanwhile cannot lose it. A daemon that processed the model
    again has a new digest (the processing daemon's boot id is part of the layout), so nothing
    stale is ever reused; one that took the arena over from its keeper keeps the digest, as the
    layout and the memory are the same."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._manifests: collections.OrderedDict[LayoutKey, Manifest] = collections.OrderedDict()
        self._lock = threading.Lock()

    def known(self, key: LayoutKey) -> Manifest | None:
        with self._lock:
            return self._manifests.get(key)

    def complete(self, key: LayoutKey, grant: LeaseGrant, named: Manifest | None) -> LeaseGrant:
        """The grant with its manifest: the one it carries (remembered for next time), else the
        one the request named as known."""
        if grant.manifest is None:
            if named is None or named.layout_digest != grant.layout_digest:
                raise VerificationError(
                    "the daemon left out a layout this client did not name",
                    reason=Reason.manifest_invalid,
                )
            return grant.model_copy(update={"manifest": named})
        with self._lock:
            self._manifests[key] = grant.manifest
            self._manifests.move_to_end(key)
            while len(self._manifests) > self.size:
                self._manifests.popitem(last=False)
        return grant


LAYOUTS = LayoutCache()
