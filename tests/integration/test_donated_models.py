"""Donated models in a real daemon: donated, leased, listed with their donor, checked by their
checksums, unloaded, kept across a daemon restart under a keeper, counted in its metrics, and
evicted (unleased only) when a load or another donation needs room; the pending arena passed to
its donor alone, read-write, by the handle socket; a GPU donation refused, typed, by a daemon
that holds no arena on that GPU."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from engine_client.arenas import open_arena
from engine_client.attach import Attachment, attach
from engine_client.client import ClientConfig, DaemonClient
from engine_client.donations import (
    abandon_call,
    bytes_donated_here,
    donated_specs,
    offer_call,
)
from engine_client.verify import Expectations
from harness.daemon_process import (
    DaemonProcess,
    KeptDaemons,
    free_port,
    lease_body,
    start_daemon,
    stop_keeper,
)
from harness.donating import ABSENT_GPU, donate_tensors, key_for, some_tensors
from harness.hostile.handle_holder import present_elsewhere
from harness.waiting import wait_for
from protocol.errors import DonationDeviceError, HandleRefusedError, WeightCacheError
from protocol.handle_socket import fetch_arena_fd
from protocol.schemas.donated import DONATED_KERNEL, DonationKey
from protocol.schemas.donations import DonationOffer, DonationRequest
from protocol.schemas.manifest import ArenaDescriptor, HandleAccess, ShmHandle


@pytest.fixture
def daemon(tmp_path: Path, tiny_fp8: Path) -> Iterator[DaemonProcess]:
    process = start_daemon(tmp_path, [tiny_fp8], "--model-id", "tiny")
    yield process
    process.stop()


def _attach(url: str, model: str) -> Attachment:
    """A lease on the donated model ``model``, every byte checked against its checksum."""
    expect = Expectations(
        torch.device("cpu"),
        kernel=DONATED_KERNEL,
        supported_schemes=frozenset(),
        verify_checksums=True,
    )
    return attach(model, expect, config=ClientConfig.from_env(url=url))


def test_a_donation_is_leased_zero_copy_with_its_bytes(
    daemon: DaemonProcess, tiny_fp8: Path
) -> None:
    tensors = some_tensors()
    given_before = bytes_donated_here()
    model = donate_tensors(daemon.url, key_for(tiny_fp8), tensors)
    with _attach(daemon.url, model) as attachment:
        assert attachment.zero_copy()
        for name, tensor in tensors.items():
            leased = attachment.tensors[name]
            assert leased.stride() == tensor.stride()
            assert torch.equal(leased, tensor)
        with httpx.Client(base_url=daemon.url) as http:
            info = http.get(f"/v1/models/{model}").json()
            listed = http.get("/v1/donations").json()
            inventory = http.get("/v1/inventory").json()
        assert info["state"] == "ready" and info["active_leases"] == 1
        assert info["donor"]["uid"] == os.geteuid() and info["donor"]["pid"] == os.getpid()
        assert [d["model"] for d in listed] == [model]
        assert model in {m["id"] for m in inventory["models"]}
    # What this process gave is what the daemon holds for it, counted as this process's own
    # when it sizes a KV cache (engine_client.vllm.startup.counted_as_own).
    assert bytes_donated_here() - given_before == info["bytes_resident"] > 0


def test_a_rank_of_many_tensors_is_donated(daemon: DaemonProcess, tiny_fp8: Path) -> None:
    """A real model's rank lists hundreds of tensors (roles, entries, checksums): its offer and
    commit exceed the general body limit and pass under the donation routes' own."""
    tensors = {f"model.layers.{i}.scale": torch.full((2,), float(i)) for i in range(2000)}
    model = donate_tensors(daemon.url, key_for(tiny_fp8), tensors)
    with _attach(daemon.url, model) as attachment:
        assert len(attachment.tensors) == 2000
        assert torch.equal(
            attachment.tensors["model.layers.1999.scale"], tensors["model.layers.1999.scale"]
        )


def test_a_modelopt_lease_on_a_donated_model_is_refused(
    daemon: DaemonProcess, tiny_fp8: Path
) -> None:
    """A donated model serves its donor's kernels, never the daemon's CUTLASS layout."""
    model = donate_tensors(daemon.url, key_for(tiny_fp8))
    with httpx.Client(base_url=daemon.url) as http:
        r = http.post("/v1/leases", json=lease_body(model))
    assert r.status_code == 409 and r.json()["code"] == "layout_mismatch"
    assert r.json()["mismatches"]["kernel"] == {"requested": "cutlass", "served": "donated"}


def test_a_donated_model_unloads(daemon: DaemonProcess, tiny_fp8: Path) -> None:
    model = donate_tensors(daemon.url, key_for(tiny_fp8))
    with httpx.Client(base_url=daemon.url) as http:
        assert http.delete(f"/v1/models/{model}").status_code == 204
        assert http.get("/v1/donations").json() == []
    # Gone, it may be donated again.
    assert donate_tensors(daemon.url, key_for(tiny_fp8)) == model


def test_a_donated_model_survives_a_restart_under_the_keeper(
    tmp_path: Path, tiny_fp8: Path
) -> None:
    tensors = some_tensors(seed=3)
    with KeptDaemons(tmp_path, tiny_fp8) as kept:
        model = donate_tensors(kept.first.url, key_for(tiny_fp8), tensors)
        kept.first.stop()
        second = kept.restart()
        with httpx.Client(base_url=second.url) as http:
            info = http.get(f"/v1/models/{model}").json()
        assert info["state"] == "ready", info
        assert info["donor"]["pid"] == os.getpid()
        with _attach(second.url, model) as attachment:
            for name, tensor in tensors.items():
                assert torch.equal(attachment.tensors[name], tensor)


def test_a_pending_arena_goes_to_its_donor_alone_read_write(
    daemon: DaemonProcess, tiny_fp8: Path
) -> None:
    """The donor maps the arena it is offered read-write through the handle socket (as a GPU
    donor maps a shareable allocation); a wrong secret, another process with the secret, and
    anyone once the donation is gone are refused."""
    tensors = some_tensors()
    request = DonationRequest(
        key=key_for(tiny_fp8), tensors=donated_specs(tensors), client_pid=os.getpid()
    )
    config = ClientConfig.from_env(url=daemon.url)
    with DaemonClient(config) as client:
        offer = client.send(offer_call(request))
    handle = offer.handle
    assert isinstance(handle, ShmHandle) and handle.access is not None
    access: HandleAccess = handle.access
    descriptor = ArenaDescriptor(index=0, nbytes=offer.nbytes, handle=handle)
    opened = open_arena(descriptor, offer.model, writable=True)
    assert opened.base is not None
    assert opened.via == "descriptor" and not opened.read_only
    opened.base[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    opened.close()

    with pytest.raises(HandleRefusedError) as err:
        fetch_arena_fd(access.model_copy(update={"secret": "x" * 32}), offer.model, 0)
    assert err.value.extra["why"] == "the secret is not this lease's"
    answer = present_elsewhere(access, offer.model)
    assert answer["code"] == "handle_refused" and "is not the lease's holder" in str(answer["why"])

    with DaemonClient(config) as client:
        client.send(abandon_call(offer.model, offer.secret))
    with pytest.raises(HandleRefusedError):  # no pending donation by that id any more
        fetch_arena_fd(access, offer.model, 0)


def test_a_gpu_donation_is_refused_by_a_daemon_on_the_cpu(
    daemon: DaemonProcess, tiny_fp8: Path
) -> None:
    """A key of a GPU asks for an arena on that GPU: a daemon on the CPU refuses it, typed and
    with its hint, and registers nothing."""
    given_before = bytes_donated_here()
    with pytest.raises(DonationDeviceError) as err:
        donate_tensors(daemon.url, key_for(tiny_fp8, **ABSENT_GPU))
    assert bytes_donated_here() == given_before  # nothing given, nothing counted
    assert "host shared memory only" in err.value.detail
    assert err.value.extra["device"] == ABSENT_GPU["device_uuid"]
    with httpx.Client(base_url=daemon.url) as http:
        assert http.get("/v1/donations").json() == []
        assert not [m for m in http.get("/v1/models").json() if m["donor"]]
        refused = http.post(
            "/v1/donations",
            json=DonationRequest(
                key=key_for(tiny_fp8, **ABSENT_GPU),
                tensors=donated_specs(some_tensors()),
                client_pid=os.getpid(),
            ).model_dump(mode="json"),
        )
    assert refused.status_code == 409 and refused.json()["code"] == "donation_device"
    assert refused.json()["hint"] == DonationDeviceError.hint


# --- metrics ----------------------------------------------------------------------------------


def _samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample ``/metrics`` shows, by name and labels."""
    text = httpx.get(f"{url}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _offer(url: str, key: DonationKey) -> DonationOffer:
    """An offer for :func:`some_tensors` under ``key``, left pending."""
    request = DonationRequest(
        key=key, tensors=donated_specs(some_tensors()), client_pid=os.getpid()
    )
    with DaemonClient(ClientConfig.from_env(url=url)) as client:
        return client.send(offer_call(request))


def test_donations_are_counted_and_donated_models_in_the_model_gauges(
    daemon: DaemonProcess, tiny_fp8: Path
) -> None:
    model = donate_tensors(daemon.url, key_for(tiny_fp8))
    with httpx.Client(base_url=daemon.url) as http:
        again = http.post(
            "/v1/donations",
            json=DonationRequest(
                key=key_for(tiny_fp8),
                tensors=donated_specs(some_tensors()),
                client_pid=os.getpid(),
            ).model_dump(mode="json"),
        )
        assert again.status_code == 409
        abandoned = _offer(daemon.url, key_for(tiny_fp8, max_model_len=512))
        assert http.post(
            f"/v1/donations/{abandoned.model}/abandon", json={"secret": abandoned.secret}
        ).is_success
        unloaded = _offer(daemon.url, key_for(tiny_fp8, max_model_len=1024))
        assert http.delete(f"/v1/models/{unloaded.model}").status_code == 204
        assert [d["model"] for d in http.get("/v1/donations").json()] == [model]
        pending = _offer(daemon.url, key_for(tiny_fp8, max_model_len=2048))
        held = http.get(f"/v1/models/{model}").json()["bytes_resident"]
    assert held > 0
    samples = _samples(daemon.url)
    expected = {
        ("weight_cache_donations_offered_total", ()): 4.0,
        ("weight_cache_donations_committed_total", ()): 1.0,
        ("weight_cache_donations_refused_total", (("code", "donation_exists"),)): 1.0,
        ("weight_cache_donations_abandoned_total", (("why", "donor"),)): 1.0,
        ("weight_cache_donations_abandoned_total", (("why", "unloaded"),)): 1.0,
        ("weight_cache_donated_models", (("state", "ready"),)): 1.0,
        ("weight_cache_donated_models", (("state", "loading"),)): 1.0,
        ("weight_cache_donated_resident_bytes", ()): float(held),
        # Counted with the daemon's own models: the demo model and the donated one are ready,
        # the pending donation is loading.
        ("weight_cache_models", (("state", "ready"),)): 2.0,
        ("weight_cache_models", (("state", "loading"),)): 1.0,
        ("weight_cache_resident_bytes", (("model", model),)): float(held),
        ("weight_cache_resident_bytes", (("model", pending.model),)): 0.0,
    }
    assert {k: samples.get(k) for k in expected} == expected


# --- eviction ---------------------------------------------------------------------------------

DONATED_BYTES = 1 << 19  # one donation below: a 512 KiB tensor


def _bare_daemon(tmp_path: Path, *extra: str, **options: Any) -> DaemonProcess:
    """A daemon with no model of its own (not even its demo model): its memory is the
    donations'. ``/ready`` waits for models, so only its answering is waited for."""
    return start_daemon(tmp_path, [], "--model", "", *extra, wait_ready=False, **options)


def _big(seed: int) -> dict[str, torch.Tensor]:
    return {"layer.weight": torch.full((DONATED_BYTES // 2,), float(seed), dtype=torch.bfloat16)}


def _models(url: str) -> dict[str, str]:
    return {m["id"]: m["state"] for m in httpx.get(f"{url}/v1/models").json()}


def _arena_files(shm: Path, model: str) -> list[Path]:
    return [p for p in shm.rglob("*") if model in p.name]


def test_an_unleased_donated_model_is_evicted_for_a_donation_a_leased_one_never(
    tmp_path: Path, tiny_fp8: Path
) -> None:
    """Under a budget of one donation: the second evicts the first while nothing leases it,
    and is refused while a lease does."""
    daemon = _bare_daemon(tmp_path, "--memory-budget", str(DONATED_BYTES * 3 // 2))
    try:
        first = donate_tensors(daemon.url, key_for(tiny_fp8), _big(1))
        assert _arena_files(tmp_path / "shm", first)
        second_key = key_for(tiny_fp8, max_model_len=512)
        with _attach(daemon.url, first) as attachment:
            with pytest.raises(WeightCacheError) as refused:
                donate_tensors(daemon.url, second_key, _big(2))
            assert refused.value.code == "insufficient_memory"
            assert _models(daemon.url) == {first: "ready"}
            assert torch.equal(attachment.tensors["layer.weight"], _big(1)["layer.weight"])
        second = donate_tensors(daemon.url, second_key, _big(2))
        assert _models(daemon.url) == {second: "ready"}
        assert [d["model"] for d in httpx.get(f"{daemon.url}/v1/donations").json()] == [second]
        assert not _arena_files(tmp_path / "shm", first)
        samples = _samples(daemon.url)
        assert samples[("weight_cache_evictions_total", (("pressure", "memory_budget"),))] == 1
        assert samples[("weight_cache_donated_resident_bytes", ())] == DONATED_BYTES
        refusal = ("weight_cache_donations_refused_total", (("code", "insufficient_memory"),))
        assert samples[refusal] == 1
    finally:
        daemon.stop()


def test_the_least_recently_used_donated_model_goes_first(tmp_path: Path, tiny_fp8: Path) -> None:
    daemon = _bare_daemon(tmp_path, "--memory-budget", str(DONATED_BYTES * 5 // 2))
    try:
        older = donate_tensors(daemon.url, key_for(tiny_fp8), _big(1))
        newer = donate_tensors(daemon.url, key_for(tiny_fp8, max_model_len=512), _big(2))
        with _attach(daemon.url, older):
            pass  # leased and released: used after ``newer`` was donated
        third = donate_tensors(daemon.url, key_for(tiny_fp8, max_model_len=1024), _big(3))
        assert _models(daemon.url) == {older: "ready", third: "ready"}
        assert newer not in _models(daemon.url)
    finally:
        daemon.stop()


def test_a_load_at_the_model_cap_evicts_a_donated_model_never_a_loaded_one(
    tmp_path: Path, tiny_fp8: Path, tiny_pc: Path
) -> None:
    daemon = _bare_daemon(tmp_path, "--max-models", "1", "--allowed-root", str(tiny_fp8.parent))
    try:
        donated = donate_tensors(daemon.url, key_for(tiny_fp8))
        with httpx.Client(base_url=daemon.url) as http:
            r = http.post("/v1/models", json={"path": str(tiny_fp8), "id": "tiny"})
            assert r.status_code == 202, r.text
            wait_for(lambda: _models(daemon.url) == {"tiny": "ready"})
            # The cap is held by a model the daemon loaded: a donation is refused, not it.
            with pytest.raises(WeightCacheError) as refused:
                donate_tensors(daemon.url, key_for(tiny_pc))
            assert refused.value.code == "too_many_models"
            r = http.post("/v1/models", json={"path": str(tiny_pc), "id": "pc"})
            assert r.status_code == 429 and r.json()["code"] == "too_many_models"
        assert _models(daemon.url) == {"tiny": "ready"}
        assert donated not in _models(daemon.url)
        samples = _samples(daemon.url)
        assert samples[("weight_cache_evictions_total", (("pressure", "max_models"),))] == 1
    finally:
        daemon.stop()


def test_an_evicted_donated_model_is_gone_from_the_keeper(tmp_path: Path, tiny_fp8: Path) -> None:
    """The keeper lets go of an evicted model: the next daemon adopts only the one held."""
    port, run, shm = free_port(), tmp_path / "run", tmp_path / "shm"
    budget = ("--memory-budget", str(DONATED_BYTES * 3 // 2))
    first = _bare_daemon(tmp_path, *budget, port=port, run_dir=run, keeper="auto")
    second: DaemonProcess | None = None
    try:
        evicted = donate_tensors(first.url, key_for(tiny_fp8), _big(1))
        held = donate_tensors(first.url, key_for(tiny_fp8, max_model_len=512), _big(2))
        assert _models(first.url) == {held: "ready"}
        first.stop()
        second = _bare_daemon(tmp_path, *budget, port=port, run_dir=run, keeper="auto")
        assert _models(second.url) == {held: "ready"}
        assert not _arena_files(shm, evicted)
        with _attach(second.url, held) as attachment:
            assert torch.equal(attachment.tensors["layer.weight"], _big(2)["layer.weight"])
    finally:
        first.stop(signal.SIGKILL)
        if second is not None:
            second.stop()
        stop_keeper(run)
