"""Donating is writing what other engines compute with: a neighbour may not donate, a token
holder only where the operator allows it, and a donated model is never overwritten: not by a
second donation of its key, not by a commit without the offer's secret, not by bytes that do
not match their checksums. Users here are real uids (a child process dropped to them), on a
daemon serving every local user over loopback TCP (``--trust-local-users``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.daemon_process import DaemonProcess, start_daemon
from harness.donating import donate_tensors, key_for, some_tensors, state_of
from harness.hostile.users import NOBODY, UserAgent, needs_root
from protocol.schemas.donations import DonatedTensorSpec, DonationRequest
from protocol.schemas.layout import WireDType

TOKEN = "donation-test-token-0123456789abcdef"


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    process = start_daemon(tmp_path, [], env={"WEIGHT_CACHE_TRUST_LOCAL_USERS": "true"})
    yield process
    process.stop()


def _request(checkpoint: Path, client_pid: int, **key: object) -> dict[str, object]:
    tensors = some_tensors()
    specs = [
        DonatedTensorSpec(name=n, dtype=WireDType.bfloat16, nbytes=t.numel() * 2)
        for n, t in tensors.items()
    ]
    body = DonationRequest(key=key_for(checkpoint, **key), tensors=specs, client_pid=client_pid)
    return body.model_dump(mode="json")


@needs_root
def test_another_user_cannot_donate(daemon: DaemonProcess, tiny_fp8: Path) -> None:
    with UserAgent(daemon.url, NOBODY) as neighbour:
        status, body = neighbour.request("POST", "/v1/donations", _request(tiny_fp8, neighbour.pid))
    assert status == 403 and body["code"] == "donation_not_allowed", body
    with httpx.Client(base_url=daemon.url) as http:
        assert http.get("/v1/donations").json() == []
        assert not [m for m in http.get("/v1/models").json() if m["donor"]]


@needs_root
def test_a_neighbour_cannot_send_a_donation_sized_body(
    daemon: DaemonProcess, tiny_fp8: Path
) -> None:
    """The donation routes take bodies of megabytes from callers allowed to donate; anyone else
    meets the general limit there, before the daemon reads the body."""
    with UserAgent(daemon.url, NOBODY) as neighbour:
        body = dict(_request(tiny_fp8, neighbour.pid), padding="x" * 200_000)
        status, answer = neighbour.request("POST", "/v1/donations", body)
    assert status == 413 and answer["code"] == "payload_too_large", answer
    with httpx.Client(base_url=daemon.url) as http:
        r = http.post("/v1/donations", json=body)  # the daemon's own user: past the limit
        assert r.status_code == 422, r.text  # the padding is refused by the schema, not its size


@needs_root
@pytest.mark.parametrize("allowed", [False, True])
def test_a_token_holder_donates_only_where_allowed(
    tmp_path: Path, tiny_fp8: Path, allowed: bool
) -> None:
    env = {"WEIGHT_CACHE_TOKEN": TOKEN, "WEIGHT_CACHE_ALLOW_TOKEN_DONATIONS": str(allowed).lower()}
    daemon = start_daemon(tmp_path, [], env=env)
    try:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        with UserAgent(daemon.url, NOBODY) as holder:
            body = _request(tiny_fp8, holder.pid)
            status, answer = holder.request("POST", "/v1/donations", body, headers=headers)
        if allowed:
            assert status == 201, answer
            assert answer["model"].startswith("donated-")
        else:
            assert status == 403 and answer["code"] == "donation_not_allowed", answer
    finally:
        daemon.stop()


def test_a_donated_model_is_not_overwritten(daemon: DaemonProcess, tiny_fp8: Path) -> None:
    model = donate_tensors(daemon.url, key_for(tiny_fp8))
    with httpx.Client(base_url=daemon.url) as http:
        again = http.post("/v1/donations", json=_request(tiny_fp8, os.getpid()))
        assert again.status_code == 409 and again.json()["code"] == "donation_exists"
        # A commit onto the held model: no pending donation by that id takes it.
        commit: dict[str, object] = {
            "secret": "0" * 32,
            "tensors": [],
            "state": state_of(some_tensors()).model_dump(mode="json"),
        }
        r = http.post(f"/v1/donations/{model}/commit", json=commit)
        assert r.status_code == 422  # no tensors: refused before it reaches the model
        commit["tensors"] = [
            {
                "name": "layer.bias",
                "arena": 0,
                "offset": 0,
                "nbytes": 96,
                "dtype": "bfloat16",
                "shape": [48],
                "stride": [1],
                "checksum": "0" * 16,
            }
        ]
        r = http.post(f"/v1/donations/{model}/commit", json=commit)
        assert r.status_code == 404 and r.json()["code"] == "donation_not_found"
        assert http.get(f"/v1/models/{model}").json()["state"] == "ready"


def test_a_pending_donation_is_committed_only_by_its_donor(
    daemon: DaemonProcess, tiny_fp8: Path
) -> None:
    request = _request(tiny_fp8, os.getpid())
    sizes = {t["name"]: t["nbytes"] for t in request["tensors"]}  # type: ignore[attr-defined]
    with httpx.Client(base_url=daemon.url) as http:
        offer = http.post("/v1/donations", json=request).json()
        commit = {
            "secret": "f" * 32,
            "tensors": [
                {
                    "name": name,
                    "arena": 0,
                    "offset": offset,
                    "nbytes": sizes[name],
                    "dtype": "bfloat16",
                    "shape": [sizes[name] // 2],
                    "stride": [1],
                    "checksum": "0" * 16,  # not the checksum of the bytes written (zeros)
                }
                for name, offset in offer["offsets"].items()
            ],
            "state": state_of(some_tensors()).model_dump(mode="json"),
        }
        r = http.post(f"/v1/donations/{offer['model']}/commit", json=commit)
        assert r.status_code == 403 and r.json()["code"] == "donation_not_yours"
        # The donor's own commit of bytes that do not match their checksums is refused, and the
        # donation is gone with its arena.
        commit["secret"] = offer["secret"]
        r = http.post(f"/v1/donations/{offer['model']}/commit", json=commit)
        assert r.status_code == 422 and r.json()["code"] == "donation_invalid", r.json()
        assert "checksum" in r.json()["detail"]
        assert http.get("/v1/donations").json() == []
        assert not Path(offer["handle"]["path"]).exists()
