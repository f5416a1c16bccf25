"""What a lease hands out: the lease, a freshly exported handle, and the rank's manifest unless
the client already holds that layout.

The manifest's layout (hundreds of tensors and layers) never changes while a model is resident,
so its JSON is rendered once at load time and a grant only splices in the lease and the handle:
the bytes equal the ``LeaseGrant`` model's JSON (a test holds them to it) at a fraction of the
cost. A client that sends back ``layout_digest`` as ``known_layout`` skips the layout entirely.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import TypeAdapter

from service.registry.loader import ResidentRank
from service.schemas.leases import LeaseGrant, LeaseInfo
from service.schemas.manifest import ArenaDescriptor, Manifest

_ARENAS = TypeAdapter(list[ArenaDescriptor])


@dataclass(frozen=True)
class Grant:
    lease: LeaseInfo
    rank: ResidentRank
    arenas: list[ArenaDescriptor]
    with_manifest: bool  # False when the client said it holds this layout

    @property
    def manifest(self) -> Manifest:
        return self.rank.manifest.model_copy(update={"arenas": self.arenas})

    def model(self) -> LeaseGrant:
        return LeaseGrant(
            lease=self.lease,
            layout_digest=self.rank.manifest.layout_digest,
            arenas=self.arenas,
            manifest=self.manifest if self.with_manifest else None,
        )

    def render(self) -> bytes:
        """The ``LeaseGrant`` JSON, from the layout rendered at load time."""
        arenas = _ARENAS.dump_json(self.arenas)
        manifest = (
            b"".join((self.rank.manifest_json[:-1], b',"arenas":', arenas, b"}"))
            if self.with_manifest
            else b"null"
        )
        return b"".join(
            (
                b'{"lease":',
                self.lease.model_dump_json().encode(),
                b',"layout_digest":"',
                self.rank.manifest.layout_digest.encode(),
                b'","arenas":',
                arenas,
                b',"manifest":',
                manifest,
                b"}",
            )
        )
