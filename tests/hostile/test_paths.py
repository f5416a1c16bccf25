"""Paths: FIFOs, symlink races and loops, long names, large directories and hostile names are
refused with their codes, nothing outside the allowed root is ever read, and ``/health`` keeps
answering."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from harness.checkpoint_tools import rewrite_header
from harness.hostile.probe import HealthProbe
from modelopt_fp8.checkpoint import checkpoint_fingerprint
from tests.hostile.conftest import Hostile


@pytest.mark.parametrize(
    "name",
    ["model.safetensors", "config.json", "hf_quant_config.json", "model.safetensors.index.json"],
)
def test_a_fifo_is_refused_at_once(hostile: Hostile, name: str) -> None:
    path = hostile.checkpoint(f"fifo-{name}")
    (path / name).unlink(missing_ok=True)
    os.mkfifo(path / name)  # opening it for reading the ordinary way blocks until a writer comes
    with HealthProbe(hostile.url) as probe:
        r = hostile.load(path, f"fifo-{name.replace('.', '-')}")
    assert r.status_code == 422 and r.json()["code"] == "not_regular_file"
    assert r.json()["file"].endswith(name)
    probe.assert_answered()


def test_a_device_or_directory_in_place_of_a_file(hostile: Hostile) -> None:
    path = hostile.checkpoint("dev")
    (path / "model.safetensors").unlink()
    (path / "model.safetensors").symlink_to("/dev/zero")  # outside the root as well
    r = hostile.load(path, "dev")
    assert r.status_code == 403 and r.json()["code"] == "path_not_allowed"
    path = hostile.checkpoint("dir")
    (path / "model.safetensors").unlink()
    (path / "model.safetensors").mkdir()
    r = hostile.load(path, "dir")
    assert r.status_code == 422 and r.json()["code"] == "not_regular_file"


def test_symlink_swap_race_never_reads_outside(hostile: Hostile, tmp_path: Path) -> None:
    """One thread swaps the weights between a file inside the root and a symlink to another
    checkpoint's file outside it, while models are loaded from it: each load is either
    refused (path_not_allowed) or holds the inside file (its fingerprint), never the outside."""
    inside = hostile.checkpoint("race")
    weights = inside / "model.safetensors"
    expected = checkpoint_fingerprint(inside).digest
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / "model.safetensors"
    target.write_bytes(weights.read_bytes())
    rewrite_header(target, lambda h: h.update({"__metadata__": {"origin": "outside"}}))
    good = inside / "good.bin"
    os.link(weights, good)
    link = inside / "swap.tmp"
    stop = threading.Event()

    def swap() -> None:
        for i in range(1_000_000):
            if stop.is_set():
                return
            link.unlink(missing_ok=True)
            if i % 2:
                link.symlink_to(target)
            else:
                os.link(good, link)
            os.replace(link, weights)

    outcomes: dict[str, int] = {}
    swapper = threading.Thread(target=swap, daemon=True)
    with HealthProbe(hostile.url) as probe:
        swapper.start()
        try:
            for i in range(40):
                model = f"race-{i}"
                r = hostile.load(inside, model)
                if r.status_code != 202:
                    code = r.json()["code"]
                else:
                    info = hostile.settled(model)
                    code = info["state"] if info["state"] == "ready" else info["error"]["code"]
                    if info["state"] == "ready":
                        assert info["fingerprint"] == expected  # the inside file's bytes
                    hostile.unload(model)
                outcomes[code] = outcomes.get(code, 0) + 1
        finally:
            stop.set()
            swapper.join(10)
    assert set(outcomes) <= {"ready", "path_not_allowed"}, outcomes
    assert outcomes.get("path_not_allowed", 0) > 0, outcomes  # the race was really run
    probe.assert_answered()


def test_a_symlink_out_of_the_root_echoes_no_target(hostile: Hostile, tmp_path: Path) -> None:
    secret = tmp_path / "secret-place-8c1f"
    secret.mkdir()
    link = hostile.root / "innocent"
    link.symlink_to(secret)
    r = hostile.load(link, "innocent")
    assert r.status_code == 403 and r.json()["code"] == "path_not_allowed"
    assert "secret-place" not in r.text


@pytest.mark.parametrize("where", ["directory", "weights"])
def test_long_names(hostile: Hostile, where: str) -> None:
    long = "a" * 300
    if where == "directory":
        r = hostile.load(hostile.root / long / "x", f"long-{where}")
        assert r.status_code == 422 and r.json()["code"] == "path_too_long"
        return
    path = hostile.checkpoint("long-shard")
    index = {"weight_map": {"model.embed_tokens.weight": f"{long}.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    r = hostile.load(path, f"long-{where}")
    assert r.status_code == 202  # the index is read by the load, which fails with the code
    assert hostile.settled(f"long-{where}")["error"]["code"] == "path_too_long"
    hostile.unload(f"long-{where}")


def test_symlink_loops(hostile: Hostile) -> None:
    me = hostile.root / "me"
    me.symlink_to(me)
    r = hostile.load(me, "me")
    assert r.status_code == 422 and r.json()["code"] == "symlink_refused"
    assert r.json()["reason"] == "symlink_loop"
    path = hostile.checkpoint("loop")
    (path / "model.safetensors").unlink()
    (path / "a.safetensors").symlink_to(path / "b.safetensors")
    (path / "b.safetensors").symlink_to(path / "a.safetensors")
    r = hostile.load(path, "loop")
    assert r.status_code == 422 and r.json()["code"] == "symlink_refused"


def test_a_directory_of_many_files(hostile: Hostile) -> None:
    path = hostile.checkpoint("crowded")
    for i in range(20_000):
        (path / f"{i}.txt").touch()
    (path / "model.safetensors").unlink()
    with HealthProbe(hostile.url) as probe:
        r = hostile.load(path, "crowded")
    assert r.status_code == 202
    assert hostile.settled("crowded")["error"]["code"] == "missing_tensor"
    hostile.unload("crowded")
    probe.assert_answered()


def test_control_characters_in_a_name_are_escaped_in_logs(hostile: Hostile) -> None:
    path = hostile.checkpoint("evil\nFORGED 2026 ERROR service.daemon: owned\x1b[31m")
    (path / "config.json").write_text("{")
    r = hostile.load(path, "evil")
    assert r.status_code == 202
    assert hostile.settled("evil")["error"]["code"] == "invalid_config"
    hostile.unload("evil")
    log = hostile.log()
    assert "evil\\nFORGED" in log and "\\x1b[31m" in log
    assert not any(line.startswith("FORGED") for line in log.splitlines())
    assert "\x1b" not in log
