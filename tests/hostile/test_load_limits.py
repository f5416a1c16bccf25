"""Loads a client can start: 300 POSTs used to start 305 threads and hold 1,521 open files.
Now a load past ``--max-concurrent-loads`` or a model past ``--max-models`` is refused with its
code (429, ``Retry-After`` for the loads), threads and files stay bounded, and memory comes back
once the models are unloaded."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastapi.testclient import TestClient

from harness.daemon_process import make_settings
from harness.hostile.memory import RssBack
from harness.hostile.probe import HealthProbe
from harness.waiting import wait_for
from service.api.app import create_app
from service.registry.header_budget import HeaderBudget
from tests.hostile.conftest import LIMITS, Hostile

MODELS = int(LIMITS["WEIGHT_CACHE_MAX_MODELS"])
ANYIO_THREADS = 40  # anyio's default worker-thread limit, which the routes' threads share


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_load_flood_is_bounded(hostile: Hostile) -> None:
    pid = hostile.daemon.process.pid
    base_threads, base_fds = _threads(pid), _fds(pid)
    peaks = {"threads": base_threads, "fds": base_fds}
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.01):
            peaks["threads"] = max(peaks["threads"], _threads(pid))
            peaks["fds"] = max(peaks["fds"], _fds(pid))

    def post(i: int) -> tuple[int, str]:
        r = hostile.load(hostile.tiny, f"flood-{i}")
        return r.status_code, "" if r.status_code == 202 else r.json()["code"]

    def none_loading() -> bool:
        return all(m["state"] != "loading" for m in hostile.client.get("/v1/models").json())

    watcher = threading.Thread(target=watch)
    answers: list[tuple[int, str]] = []
    with RssBack(pid), HealthProbe(hostile.url) as probe:
        watcher.start()
        try:
            with ThreadPoolExecutor(16) as pool:
                for start in range(0, 300, 16):  # 16 at once, then the loads settle
                    answers += pool.map(post, range(start, min(300, start + 16)))
                    wait_for(none_loading, timeout=60)
        finally:
            done.set()
            watcher.join()
        accepted = [i for i, (status, _) in enumerate(answers) if status == 202]
        codes = {code for status, code in answers if status != 202}
        for i in accepted:
            hostile.settled(f"flood-{i}")
        for i in accepted:
            hostile.unload(f"flood-{i}")
    # 16 at once from one caller: past its share of requests in hand (8), refused too.
    assert codes <= {"too_many_loads", "too_many_models", "too_many_open_requests"}, codes
    assert "too_many_models" in codes
    assert 0 < len(accepted) <= MODELS
    # Threads: the routes' worker threads (anyio's limit, 40), two loads at once and the
    # loading pool's; files: the 16 connections and as many that their clients closed and the
    # daemon has not yet, an arena per model, two loads' checkpoint files, and a few of the
    # runtime's (300 POSTs once held 1,521 open files).
    assert peaks["threads"] <= base_threads + ANYIO_THREADS + 2 + (os.cpu_count() or 1), peaks
    assert peaks["fds"] <= base_fds + 2 * 16 + MODELS + 2 * 8 + 8, peaks
    probe.assert_answered()


def test_loads_at_once_are_capped_with_a_retry_after(
    tmp_path: Path, tiny_fp8: Path, held_load: threading.Event
) -> None:
    """Two loads held mid-way: the third is refused with too_many_loads and Retry-After;
    once they finish, loading works again."""
    settings = make_settings(tmp_path, [], allowed_roots=[tiny_fp8.parent], max_concurrent_loads=2)
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        for name in ("a", "b"):
            assert (
                client.post("/v1/models", json={"path": str(tiny_fp8), "id": name}).status_code
                == 202
            )
        r = client.post("/v1/models", json={"path": str(tiny_fp8), "id": "c"})
        assert r.status_code == 429 and r.json()["code"] == "too_many_loads"
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["limit"] == 2
        held_load.set()
        wait_for(lambda: {m["state"] for m in client.get("/v1/models").json()} == {"ready"}, 30)
        assert client.post("/v1/models", json={"path": str(tiny_fp8), "id": "c"}).status_code == 202


def test_loads_at_once_share_a_budget_of_headers(
    tmp_path: Path, tiny_fp8: Path, held_load: threading.Event
) -> None:
    """Loads whose safetensors headers together pass the budget (here one load's fill it): the
    next one waits before it reads a header, an unload ends its wait, and once the first load
    ends the next one runs."""
    settings = make_settings(tmp_path, [], allowed_roots=[tiny_fp8.parent], max_concurrent_loads=4)
    app = create_app(settings)
    budget = app.state.daemon.models.header_budget = HeaderBudget(1)

    def model(name: str) -> dict:
        info: dict = client.get(f"/v1/models/{name}").json()
        return info

    with TestClient(app, raise_server_exceptions=False) as client:
        for name in ("a", "b", "c"):
            r = client.post("/v1/models", json={"path": str(tiny_fp8), "id": name})
            assert r.status_code == 202
        wait_for(lambda: budget.held == 1 and budget.waiting == 2, 30)
        waiting = [n for n in ("a", "b", "c") if model(n)["fingerprint"] is None]
        assert len(waiting) == 2  # not opened: no header read
        assert client.delete(f"/v1/models/{waiting[0]}").status_code == 204
        wait_for(lambda: budget.waiting == 1, 30)
        held_load.set()
        wait_for(
            lambda: {model(n)["state"] for n in ("a", "b", "c") if n != waiting[0]} == {"ready"}, 30
        )
        assert budget.held == 0 and budget.waiting == 0
