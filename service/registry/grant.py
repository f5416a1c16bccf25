"""What a lease hands out: the lease, freshly exported handles, and the rank's manifest unless
the client already holds that layout.

The manifest (hundreds of tensors and layers) never changes while a model is resident, so its
JSON is rendered once at load time and a grant only writes the lease and the handles around it:
the bytes equal the ``LeaseGrant`` model's JSON (a test holds them to it) at a fraction of the
cost. A client that sends back ``layout_digest`` as ``known_layout`` skips the manifest entirely.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import TypeAdapter

from protocol.schemas.leases import LeaseGrant, LeaseInfo
from protocol.schemas.manifest import ArenaDescriptor
from service.registry.loader import ResidentRank

_ARENAS = TypeAdapter(list[ArenaDescriptor])


@dataclass(frozen=True)
class Grant:
    lease: LeaseInfo
    rank: ResidentRank
    arenas: list[ArenaDescriptor]
    with_manifest: bool  # False when the client said it holds this layout

    def as_schema(self) -> LeaseGrant:
        """The grant as the ``LeaseGrant`` schema (what :meth:`render` writes, built slowly)."""
        return LeaseGrant(
            lease=self.lease,
            layout_digest=self.rank.manifest.layout_digest,
            arenas=self.arenas,
            manifest=self.rank.manifest if self.with_manifest else None,
        )

    def render(self) -> bytes:
        """The ``LeaseGrant`` JSON, around the manifest rendered at load time."""
        return b"".join(
            (
                b'{"lease":',
                self.lease.model_dump_json().encode(),
                b',"layout_digest":"',
                self.rank.manifest.layout_digest.encode(),
                b'","arenas":',
                _ARENAS.dump_json(self.arenas),
                b',"manifest":',
                self.rank.manifest_json if self.with_manifest else b"null",
                b"}",
            )
        )
