"""Attaching to leased weights: lease, verify, open the arena once, rebuild every tensor as a
zero-copy view with the manifest's exact dtype, shape and stride, and keep the lease alive until
the attachment is closed (or the process exits).

:func:`attach` raises only typed errors: the client, verification and the arena opener raise
their own, and anything else in verifying or rebuilding is mapped here with the step's reason."""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine_client.arenas import OpenedArena, open_arena, release_unopened
from engine_client.client import ClientConfig, DaemonClient
from engine_client.fallback import typed_failures
from engine_client.verify import Expectations, verify_checksums, verify_grant
from protocol.errors import DaemonUnavailableError, ModelLoadingError, WeightCacheError
from protocol.logsafe import get_logger
from protocol.reasons import Reason
from protocol.schemas.layout import LayerLayout
from protocol.schemas.leases import LeaseGrant
from protocol.schemas.manifest import Manifest

log = get_logger(__name__)


@dataclass
class AttachTimings:
    lease_ms: float = 0.0  # request sent to manifest parsed
    verify_ms: float = 0.0
    open_ms: float = 0.0  # IPC open or mmap
    rebuild_ms: float = 0.0
    checksum_ms: float = 0.0

    @property
    def attach_ms(self) -> float:
        return self.lease_ms + self.verify_ms + self.open_ms + self.rebuild_ms + self.checksum_ms


class LeaseKeeper(threading.Thread):
    """Renews a lease every third of its TTL and reports its loss to ``on_lost``.

    A daemon that does not answer (stopped, crashed, being upgraded) is waited for as long as it
    takes, retrying at the renewal interval and logging at growing intervals: the engine keeps
    serving from the memory it maps, which nothing frees under it. A daemon that answers again
    has taken the lease over (a keeper held it) and the renewals go on; a definitive answer
    (expired, unknown, daemon restarted without the lease) ends it.
    """

    def __init__(
        self,
        config: ClientConfig,
        lease_id: str,
        ttl_s: float,
        on_lost: Callable[[WeightCacheError], None],
        every_s: float | None = None,
    ) -> None:
        super().__init__(name=f"lease-{lease_id[-8:]}", daemon=True)
        self.config = config
        self.lease_id = lease_id
        self.ttl_s = ttl_s
        self.interval = every_s or max(0.05, ttl_s / 3)
        self.on_lost = on_lost
        self.stopped = threading.Event()
        self.renewals = 0
        self.boot_id: str | None = None  # the daemon that renewed last
        self.unanswered = 0  # renewals in a row that reached no daemon

    def run(self) -> None:
        with DaemonClient(self.config) as client:
            while not self.stopped.wait(self.interval):
                try:
                    info = client.renew(self.lease_id)
                except DaemonUnavailableError as exc:
                    self.unanswered += 1
                    if self.unanswered & (self.unanswered - 1) == 0:  # 1, 2, 4, 8, ... tries
                        log.warning(
                            "renewing lease %s: %s; waiting for the daemon (the engine goes on "
                            "serving; %d tries so far)",
                            self.lease_id,
                            exc,
                            self.unanswered,
                        )
                    continue
                except WeightCacheError as exc:
                    self._lose(exc)
                    return
                if self.unanswered or (self.boot_id and info.boot_id != self.boot_id):
                    log.info(
                        "lease %s renewed by daemon %s after %d unanswered tries: taken over",
                        self.lease_id,
                        info.boot_id,
                        self.unanswered,
                    )
                self.unanswered = 0
                self.boot_id = info.boot_id
                self.renewals += 1

    def _lose(self, error: WeightCacheError) -> None:
        if self.stopped.is_set():  # closing raced a renewal: the lease was given up on purpose
            return
        log.error("lease %s lost: %s", self.lease_id, error)
        self.on_lost(error)

    def stop(self) -> None:
        self.stopped.set()


def _rebuild(
    manifest: Manifest, base: torch.Tensor
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(views, storages) for every tensor of the manifest, all pointing into ``base``."""
    views, storages = {}, {}
    for t in manifest.tensors:
        storages[t.name] = t.storage(base)
        views[t.name] = t.view(base)
    return views, storages


@dataclass(eq=False)  # identity: one attachment is one lease
class Attachment:
    """Leased, verified, zero-copy tensors. Close it (or leave the ``with`` block) to release."""

    config: ClientConfig
    grant: LeaseGrant
    tensors: dict[str, torch.Tensor]
    storages: dict[str, torch.Tensor]
    arena: OpenedArena
    timings: AttachTimings
    keeper: LeaseKeeper | None = None
    lost: WeightCacheError | None = None
    on_lost: list[Callable[[WeightCacheError], None]] = field(default_factory=list)
    closed: bool = False

    @property
    def manifest(self) -> Manifest:
        return self.grant.full_manifest()

    @property
    def lease_id(self) -> str:
        return self.grant.lease.id

    @property
    def layers(self) -> list[LayerLayout]:
        return self.manifest.layers

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.manifest.tensors)

    def zero_copy(self) -> bool:
        """Whether every tensor points into the mapped arena at its manifest offset."""
        arena = self.arena.base
        if arena is None:
            return False
        base, storage = arena.data_ptr(), arena.untyped_storage().data_ptr()
        return all(
            self.tensors[t.name].data_ptr() == base + t.offset
            and self.tensors[t.name].untyped_storage().data_ptr() == storage
            for t in self.manifest.tensors
        )

    def _lost(self, error: WeightCacheError) -> None:
        self.lost = error
        for callback in self.on_lost:
            callback(error)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.keeper is not None:
            self.keeper.stop()
        if self.lost is None:
            try:
                with DaemonClient(self.config) as client:
                    client.release(self.lease_id)
            except WeightCacheError as exc:
                log.warning("releasing lease %s: %s", self.lease_id, exc)
        self.tensors.clear()
        self.storages.clear()
        self.arena.close()

    def __enter__(self) -> Attachment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_OPEN: weakref.WeakSet[Attachment] = weakref.WeakSet()


@atexit.register
def _release_at_exit() -> None:
    """Release the leases still held when the process exits (their memory stays mapped)."""
    for attachment in list(_OPEN):
        attachment.close()


def attach(
    model: str,
    expect: Expectations,
    *,
    config: ClientConfig | None = None,
    ttl_s: float | None = None,
    keep_alive: bool = True,
    renew_every_s: float | None = None,
) -> Attachment:
    """Lease ``model`` for ``expect``'s rank and return its tensors, verified and zero-copy."""
    config = config or ClientConfig.from_env()
    timings = AttachTimings()
    with DaemonClient(config) as client:
        start = time.perf_counter()
        grant = client.lease(
            model,
            tp_rank=expect.tp_rank,
            tp_size=expect.tp_size,
            kernel=expect.kernel,
            format=expect.format,
            ttl_s=ttl_s,
        )
        timings.lease_ms = (time.perf_counter() - start) * 1e3
        arena: OpenedArena | None = None
        try:
            start = time.perf_counter()
            with typed_failures(Reason.manifest_invalid):
                verify_grant(grant, expect)
                manifest = grant.full_manifest()
            timings.verify_ms = (time.perf_counter() - start) * 1e3
            start = time.perf_counter()
            arena = open_arena(grant.arenas[0], grant.lease.id, config.handle_socket)
            timings.open_ms = (time.perf_counter() - start) * 1e3
            start = time.perf_counter()
            with typed_failures(Reason.rebuild_failed):
                assert arena.base is not None
                tensors, storages = _rebuild(manifest, arena.base)
            timings.rebuild_ms = (time.perf_counter() - start) * 1e3
            if expect.verify_checksums:
                start = time.perf_counter()
                with typed_failures(Reason.internal_error):
                    verify_checksums(manifest, storages)
                timings.checksum_ms = (time.perf_counter() - start) * 1e3
        except BaseException:
            if arena is None:  # the handles were never opened: give back torch's IPC count
                for descriptor in grant.arenas:
                    release_unopened(descriptor.handle)
            with contextlib.suppress(WeightCacheError):
                client.release(grant.lease.id)
            if arena is not None:
                arena.close()
            raise
    attachment = Attachment(config, grant, tensors, storages, arena, timings)
    if keep_alive:
        attachment.keeper = LeaseKeeper(
            config, grant.lease.id, grant.lease.ttl_s, attachment._lost, renew_every_s
        )
        attachment.keeper.start()
    _OPEN.add(attachment)
    return attachment


def attach_waiting(
    model: str, expect: Expectations, config: ClientConfig, wait_s: float = 0.0
) -> Attachment:
    """``attach``, retrying while the daemon reports the model still loading (up to wait_s)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return attach(model, expect, config=config)
        except ModelLoadingError as exc:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            pause = min(float(exc.extra.get("retry_after_s", 1)), left, 5.0)
            log.info("%s is still loading in the daemon; retrying in %.1f s", model, pause)
            time.sleep(pause)
