"""Nothing a route does waits on the event loop: a grant, a model's info and readiness run in
a worker thread (they read /proc and stat arena files, and take the daemon's lock), so one held
up leaves ``/health`` answering. And the loading threads run at a lower CPU priority than the
thread that serves requests."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType

import httpx
import pytest

from harness.daemon_process import InProcessDaemon, lease_body, make_settings, start_daemon
from modelopt_fp8.processing.pool import lower_priority, set_loading_nice

PATIENCE_S = 10.0  # how long a held route may wait; /health must answer well within it


class ContendedLock:
    """The daemon's own lock, telling when a thread had to wait for it."""

    def __init__(self, lock: threading.RLock) -> None:
        self.lock = lock
        self.contended = threading.Event()

    def __enter__(self) -> None:
        if not self.lock.acquire(blocking=False):
            self.contended.set()
            self.lock.acquire()

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.lock.release()


@pytest.fixture
def served(tmp_path: Path, tiny_fp8: Path) -> Iterator[InProcessDaemon]:
    with InProcessDaemon(make_settings(tmp_path, [tiny_fp8], reaper_interval_s=3600)) as daemon:
        yield daemon


# Every route that enters the daemon (all but /health); {lease} is a lease granted beforehand.
ROUTES: dict[str, Callable[[httpx.Client, str], httpx.Response]] = {
    "grant": lambda c, _: c.post("/v1/leases", json=lease_body("tiny")),
    "lease": lambda c, lease: c.get(f"/v1/leases/{lease}"),
    "leases": lambda c, _: c.get("/v1/leases"),
    "renew": lambda c, lease: c.post(f"/v1/leases/{lease}/renew"),
    "release": lambda c, lease: c.delete(f"/v1/leases/{lease}"),
    "model": lambda c, _: c.get("/v1/models/tiny"),
    "models": lambda c, _: c.get("/v1/models"),
    "ready": lambda c, _: c.get("/ready"),
    "inventory": lambda c, _: c.get("/v1/inventory"),
    "metrics": lambda c, _: c.get("/metrics"),
}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_route_held_in_the_daemon_leaves_health_answering(
    served: InProcessDaemon, route: str
) -> None:
    """The daemon's lock is held (as a slow /proc read or arena stat would hold a grant): the
    route waits for it in a worker thread while /health answers on the loop; once the lock is
    free the route completes."""
    lock = ContendedLock(served.daemon.lock)
    served.daemon.lock = lock
    served.daemon.models.lock = lock  # the model table and the lease desk share the
    served.daemon.desk.lock = lock  # daemon's lock
    with (
        httpx.Client(base_url=served.url, timeout=PATIENCE_S) as held,
        httpx.Client(base_url=served.url, timeout=PATIENCE_S) as probe,
        ThreadPoolExecutor(1) as pool,
    ):
        probe.get("/health")  # connected before the lock is taken
        lease = held.post("/v1/leases", json=lease_body("tiny")).json()["lease"]["id"]
        lock.contended.clear()
        with lock.lock:
            pending = pool.submit(ROUTES[route], held, lease)
            assert lock.contended.wait(PATIENCE_S), "the route never reached the daemon"
            assert probe.get("/health").status_code == 200  # times out if the loop waits
            assert not pending.done()
        assert pending.result(PATIENCE_S).status_code in (200, 201, 204)


def _nice_of(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def test_lower_priority_lowers_only_the_calling_thread() -> None:
    base = _nice_of(os.getpid())
    seen: list[int] = []

    def loading() -> None:
        lower_priority()
        lower_priority()  # idempotent: the step is from the process's, not the thread's
        seen.append(_nice_of(threading.get_native_id()))

    set_loading_nice(3)
    try:
        thread = threading.Thread(target=loading)
        thread.start()
        thread.join()
    finally:
        set_loading_nice(0)
    assert seen == [min(19, base + 3)]
    assert _nice_of(os.getpid()) == base
    with pytest.raises(ValueError):
        set_loading_nice(20)


def _thread_nices(pid: int) -> dict[int, int]:
    """Every thread of ``pid`` and its nice value (field 19 of its stat)."""
    nices = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        nices[int(tid)] = int(stat[stat.rindex(")") + 2 :].split()[16])
    return nices


@pytest.mark.parametrize("step", [0, 7])
def test_the_daemons_loading_threads_run_below_its_event_loop(
    tmp_path: Path, tiny_fp8: Path, step: int
) -> None:
    """After a load, the shared pool's workers (they outlive it) run ``--load-nice`` steps
    below the daemon's main thread, which serves requests; with 0 nothing is lowered."""
    daemon = start_daemon(tmp_path, [tiny_fp8], "--load-nice", str(step))
    try:
        pid = daemon.process.pid
        nices = _thread_nices(pid)
        base = nices[pid]
        lowered = {tid for tid, nice in nices.items() if nice == min(19, base + step)}
        if step:
            assert lowered and pid not in lowered
            assert set(nices.values()) == {base, min(19, base + step)}
        else:
            assert set(nices.values()) == {base}
    finally:
        daemon.stop()
