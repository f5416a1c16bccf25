"""Faults with real processes and real signals: nothing lost, nothing freed under an engine."""

from __future__ import annotations

import signal
import threading
import time
from functools import partial
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file, save_file

from engine_client.attach import attach
from engine_client.checkpoint_read import attach_or_read
from engine_client.client import ClientConfig
from engine_client.verify import Expectations
from harness.daemon_process import free_port, lease_body, start_daemon
from harness.waiting import wait_for
from protocol.errors import DaemonRestartedError
from protocol.shm import map_path
from service.demo import write_demo_checkpoint
from service.memory.shm import arena_dir_path

CPU = torch.device("cpu")


def test_load_failing_halfway_returns_its_memory(tmp_path: Path, tiny_fp8: Path) -> None:
    """A corrupt tensor in the last shard: found only when the load reads it, after every
    layer before it was written. The model ends failed, its arena is gone, the other model is
    untouched, and /ready says why (ready, with --keep-going, once the other model is)."""
    broken = write_demo_checkpoint(tmp_path / "broken", "fp8", "tiny", shard_bytes=20_000)
    last = sorted(broken.glob("model-*.safetensors"))[-1]
    tensors = load_file(str(last))
    assert list(tensors) == ["lm_head.weight"]
    tensors["lm_head.weight"][100, 3] = float("nan")
    save_file(tensors, str(last), metadata={"format": "pt"})

    daemon = start_daemon(
        tmp_path, [tiny_fp8, broken], "--model-id", "tiny", "--keep-going", wait_ready=False
    )
    try:
        url = daemon.url
        wait_for(lambda: httpx.get(f"{url}/v1/models/broken").json()["state"] != "loading")
        info = httpx.get(f"{url}/v1/models/broken").json()
        assert info["state"] == "failed" and info["bytes_resident"] == 0
        assert info["error"]["code"] == "corrupt_safetensors"
        assert info["error"]["tensor"] == "lm_head.weight"
        assert info["error"]["file"] == str(last)
        assert 0 < info["progress"]["bytes_done"] < info["progress"]["bytes_total"]
        assert "lm_head.weight" in httpx.get(f"{url}/ready").json()["failed"]["broken"]
        wait_for(lambda: httpx.get(f"{url}/v1/models/tiny").json()["state"] == "ready")
        assert httpx.get(f"{url}/ready").status_code == 200
        inventory = httpx.get(f"{url}/v1/inventory").json()
        tiny = next(m for m in inventory["models"] if m["id"] == "tiny")
        assert inventory["cache_bytes"] == tiny["bytes_resident"]
        assert len(list(daemon.shm_dir.iterdir())) == 1  # only tiny's arena
        grant = httpx.post(
            f"{url}/v1/leases",
            json=lease_body(client_pid=1),
        )
        assert grant.status_code == 201
    finally:
        daemon.stop()


def test_daemon_killed_and_restarted(tmp_path: Path, tiny_fp8: Path) -> None:
    """SIGKILL the daemon under an attached engine: the engine keeps reading its mapping, its
    next renew says the daemon restarted, a new attach works against the new daemon, and the
    dead daemon's shared memory is cleaned up when the new one starts."""
    port, shm = free_port(), tmp_path / "shm"
    first = start_daemon(tmp_path, [tiny_fp8], "--model-id", "tiny", port=port, shm_dir=shm)
    config = ClientConfig(url=first.url)
    expect = Expectations.for_checkpoint(tiny_fp8, CPU)
    att = attach("tiny", expect, config=config, ttl_s=60, renew_every_s=0.1)
    lost: list[Exception] = []
    att.on_lost.append(lost.append)
    old_files = sorted(arena_dir_path(shm).iterdir())
    weight = att.layers[0].weight
    before = att.tensors[weight].clone()
    first.stop(signal.SIGKILL)
    assert first.process.returncode == -signal.SIGKILL
    assert torch.equal(att.tensors[weight], before)  # the mapping outlives the daemon

    second = start_daemon(tmp_path, [tiny_fp8], "--model-id", "tiny", port=port, shm_dir=shm)
    try:
        new_files = sorted(arena_dir_path(shm).iterdir())
        assert len(new_files) == 1 and new_files != old_files  # the dead daemon's arena is gone
        assert "removed stale shared-memory arena" in second.log.read_text()
        wait_for(lambda: bool(lost))
        assert isinstance(lost[0], DaemonRestartedError)
        assert isinstance(att.lost, DaemonRestartedError)
        assert torch.equal(att.tensors[weight], before)
        att.close()
        # With fallback allowed, the engine leases again from the new daemon.
        again = attach_or_read("tiny", tiny_fp8, expect, config=config)
        assert again.source == "daemon" and again.attachment is not None
        assert again.attachment.grant.lease.boot_id != att.grant.lease.boot_id
        again.attachment.close()
    finally:
        second.stop()
    # And with the daemon gone for good, it loads from disk and says why.
    gone = attach_or_read("tiny", tiny_fp8, expect, config=ClientConfig(url=second.url, retries=0))
    assert gone.source == "disk" and gone.reason == "daemon_unavailable"


def test_unload_racing_leases_never_frees_a_leased_arena(tmp_path: Path, tiny_fp8: Path) -> None:
    """Hammer DELETE /v1/models and POST /v1/leases (and reloads) from threads for a bounded
    time. Every granted lease must find its arena file present while it holds the lease."""
    daemon = start_daemon(
        tmp_path, [tiny_fp8], "--model-id", "tiny", "--allowed-root", str(tiny_fp8.parent)
    )
    url, give_up = daemon.url, time.monotonic() + 30.0
    problems: list[str] = []
    counts = {"granted": 0, "unloaded": 0, "in_use": 0, "reloaded": 0}
    lock = threading.Lock()

    def running() -> bool:  # until the race has happened often enough, within a time bound
        with lock:
            enough = counts["granted"] >= 50 and counts["unloaded"] >= 5 and counts["in_use"] >= 5
        return not enough and time.monotonic() < give_up

    body = lease_body(client_pid=1, ttl_s=30)

    def leaser() -> None:
        with httpx.Client(base_url=url, timeout=10) as http:
            while running():
                r = http.post("/v1/leases", json=body)
                if r.status_code != 201:
                    if r.json()["code"] not in ("model_not_found", "model_loading"):
                        problems.append(f"lease: {r.status_code} {r.text[:200]}")
                    continue
                grant = r.json()
                handle = grant["arenas"][0]["handle"]
                try:
                    view = map_path(Path(handle["path"]), handle["size"])
                    del view
                except OSError as exc:
                    problems.append(f"leased arena missing: {exc}")
                http.delete(f"/v1/leases/{grant['lease']['id']}")
                with lock:
                    counts["granted"] += 1

    def ready_state(http: httpx.Client) -> str | None:
        r = http.get("/v1/models/tiny")
        return str(r.json()["state"]) if r.status_code == 200 else None

    def lease_granted_since(count: int) -> bool:
        """One more lease granted since ``count`` were (or the race is over)."""
        with lock:
            granted = counts["granted"]
        return granted > count or not running()

    def unloader() -> None:
        with httpx.Client(base_url=url, timeout=10) as http:
            while running():
                with lock:
                    granted = counts["granted"]
                # Let leases in between unloads: one at least since the last attempt.
                wait_for(partial(lease_granted_since, granted), timeout=60, every=0.005)
                r = http.delete("/v1/models/tiny")
                with lock:
                    if r.status_code == 204:
                        counts["unloaded"] += 1
                    elif r.status_code == 409:
                        counts["in_use"] += 1
                if r.status_code == 204:
                    r = http.post("/v1/models", json={"path": str(tiny_fp8), "id": "tiny"})
                    if r.status_code == 202:
                        with lock:
                            counts["reloaded"] += 1
                        # Unload it again only once it is ready: unloading a model still
                        # loading races no lease (and leaves leasers nothing to lease).
                        wait_for(
                            lambda: not running() or ready_state(http) != "loading",
                            timeout=60,
                            every=0.005,
                        )
                elif r.status_code not in (404, 409):
                    problems.append(f"unload: {r.status_code} {r.text[:200]}")

    threads = [threading.Thread(target=leaser) for _ in range(3)] + [
        threading.Thread(target=unloader)
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert problems == []
        assert counts["granted"] >= 50 and counts["unloaded"] >= 5 and counts["in_use"] >= 5, counts
        assert httpx.get(f"{url}/health").status_code == 200
        wait_for(lambda: httpx.get(f"{url}/v1/leases").json() == [])
        # The last reload may still be loading (its arena made, not yet ready): let it finish.
        wait_for(lambda: all(m["state"] != "loading" for m in httpx.get(f"{url}/v1/models").json()))
        models = httpx.get(f"{url}/v1/models").json()
        arenas = len(list(daemon.shm_dir.iterdir()))
        assert arenas == sum(1 for m in models if m["state"] == "ready")  # nothing leaked
    finally:
        daemon.stop()
