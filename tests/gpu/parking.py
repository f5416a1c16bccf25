"""Parked engines as the proofs use them: the loader options that park an engine at its load
step, the daemon's list of parked engines (``GET /v1/parking``), and parking as an engine does
(for the proofs' stand-in engines on a machine without a GPU). All are defined here once, so the
proofs follow the daemon's API.
"""

from __future__ import annotations

import os
import time
from typing import Any

import httpx

PARKING_PATH = "/v1/parking"


def park_options(timeout_s: float) -> dict[str, Any]:
    """``--model-loader-extra-config`` keys that make an engine wait, built and holding no
    weights, until the daemon releases it (or ``timeout_s`` passes)."""
    return {"park": True, "park_timeout": timeout_s}


def parked_now(document: object) -> set[int]:
    """The pids of the engines (ranks) still waiting in a ``GET /v1/parking`` answer: a list
    of ``ParkedEngine`` (``client_pid``, ``state``; released ones stay listed a while)."""
    if not isinstance(document, list):
        return set()
    return {
        entry["client_pid"]
        for entry in document
        if isinstance(entry, dict)
        and entry.get("state") == "parked"
        and isinstance(entry.get("client_pid"), int)
    }


def parked_pids(daemon_url: str) -> set[int] | None:
    """The pids of the engines parked at the daemon now; None if it does not answer."""
    try:
        response = httpx.get(daemon_url + PARKING_PATH, timeout=2)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return parked_now(response.json())


def parking_document(daemon_url: str) -> object:
    """The daemon's parking resource as it answers it (for the summary)."""
    try:
        response = httpx.get(daemon_url + PARKING_PATH, timeout=2)
        return response.json() if response.status_code == 200 else {"status": response.status_code}
    except (httpx.HTTPError, ValueError) as exc:
        return {"error": str(exc)}


def park_and_wait(daemon_url: str, model: str, timeout_s: float) -> str:
    """Park this process as one TP rank of an engine of ``model``, wait (long-polls) until the
    daemon releases or cancels it, withdraw the registration, and return its last state
    (``released``, ``cancelled``, or ``parked`` if ``timeout_s`` passed)."""
    body = {"model": model, "tp_rank": 0, "tp_size": 1, "client_pid": os.getpid()}
    body["group"] = f"proof-{os.getpid()}"
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=daemon_url, timeout=40) as client:
        response = client.post(PARKING_PATH, json=body)
        response.raise_for_status()
        entry = response.json()
        while entry["state"] == "parked" and time.monotonic() < deadline:
            wait_s = max(0.0, min(30.0, deadline - time.monotonic()))
            response = client.get(f"{PARKING_PATH}/{entry['id']}", params={"wait_s": wait_s})
            response.raise_for_status()
            entry = response.json()
        client.delete(f"{PARKING_PATH}/{entry['id']}")
    return str(entry["state"])
