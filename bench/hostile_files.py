"""Hostile checkpoints and loads: FIFOs, crowded directories, lying configs, header bombs, a
symlink race, names that are not UTF-8, and a flood of loads."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from bench.hostile_tools import Result, Target, linked_copy, replace_file
from harness.checkpoint_tools import hollow_layers, many_layers, rewrite_header
from modelopt_fp8.checkpoint import checkpoint_fingerprint
from service.demo import write_demo_checkpoint


def _settled(client: httpx.Client, model_id: str, timeout_s: float = 600) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        info: dict[str, Any] = client.get(f"/v1/models/{model_id}").json()
        if info.get("state") != "loading" or time.monotonic() > deadline:
            return info
        time.sleep(0.01)


def _load_once(target: Target, path: Path, model_id: str) -> tuple[dict[str, Any], float]:
    """Load ``path`` over the API until it settles, then unload it: (its info, seconds)."""
    with httpx.Client(base_url=target.url, timeout=600) as client:
        start = time.perf_counter()
        r = client.post("/v1/models", json={"path": str(path), "id": model_id})
        if r.status_code != 202:
            return {"state": "refused", "error": r.json()}, time.perf_counter() - start
        info = _settled(client, model_id)
        took = time.perf_counter() - start
        client.delete(f"/v1/models/{model_id}")
    return info, took


def _code(info: dict[str, Any]) -> str:
    error = info.get("error") or {}
    return str(error.get("code", info.get("state")))


def fifo(target: Target, work: Path) -> Result:
    path = linked_copy(work, target.model, "fifo")
    (path / "model.safetensors").unlink()
    os.mkfifo(path / "model.safetensors")
    held = 0
    for i in range(20):
        r = httpx.post(f"{target.url}/v1/models", json={"path": str(path), "id": f"f{i}"})
        held += r.status_code == 422 and r.json()["code"] == "not_regular_file"
    return 20, held, "422 not_regular_file at once"


def many_files(target: Target, work: Path) -> Result:
    path = work / "crowded-txt"
    if not path.is_dir():
        path.mkdir()
        for i in range(100_000):
            (path / f"{i}.txt").touch()
    info, _ = _load_once(target, path, "crowded")
    return 1, int(_code(info) == "checkpoint_not_found"), "listed off the loop"


def lying_config(target: Target, work: Path) -> Result:
    path = linked_copy(work, target.model, "liar")
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = 1_000_000
    replace_file(path / "config.json", json.dumps(config).encode())
    info, took = _load_once(target, path, "liar")
    return 1, int(_code(info) == "invalid_config"), f"invalid_config in {took * 1e3:.0f} ms"


def deep_config(target: Target, work: Path) -> Result:
    path = linked_copy(work, target.model, "deep")
    replace_file(path / "config.json", b"[" * 100_000 + b"]" * 100_000)
    info, _ = _load_once(target, path, "deep")
    return 1, int(_code(info) == "invalid_config"), "invalid_config"


def layer_lie(target: Target, work: Path) -> Result:
    """num_hidden_layers 400,000 backed by one zero-size tensor named for the last layer (the
    probe's 130 KB file took 22 s of CPU and kept 1 GB)."""
    path = linked_copy(work, target.model, "layer-lie")
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = 400_000
    replace_file(path / "config.json", json.dumps(config).encode())
    extra = b'{"model.layers.399999.x":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}'
    extra += b" " * (-len(extra) % 8)
    (path / "zz-extra.safetensors").write_bytes(struct.pack("<Q", len(extra)) + extra)
    info, took = _load_once(target, path, "layer-lie")
    return 1, int(info["state"] == "failed"), f"{_code(info)} in {took * 1e3:.0f} ms"


BOMBS = {"bomb.safetensors": 1_140_000, "entries.safetensors": 200_000}


def _base36(n: int) -> bytes:
    """Short distinct names, so 1.14 M entries fit in the probe's 63 MiB, as its did."""
    digits = b"0123456789abcdefghijklmnopqrstuvwxyz"
    out = b""
    while True:
        n, r = divmod(n, 36)
        out = digits[r : r + 1] + out
        if not n:
            return out


def prepare_bombs(target: Target, work: Path) -> None:
    """Write the header bombs once, before any case is measured (writing 76 MiB of JSON is
    the attacker's cost, not the daemon's)."""
    where = work.parent / "bombs"
    where.mkdir(exist_ok=True)
    for name, count in BOMBS.items():
        if (where / name).is_file():
            continue
        entries = b",".join(
            b'"%s":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}' % _base36(i)
            for i in range(count)
        )
        header = b"{" + entries + b"}"
        header += b" " * (-len(header) % 8)
        (where / name).write_bytes(struct.pack("<Q", len(header)) + header)


def _bombed(target: Target, work: Path, name: str) -> Path:
    path = linked_copy(work, target.model, name.split(".", maxsplit=1)[0])
    os.link(work.parent / "bombs" / name, path / name)
    return path


def header_bomb(target: Target, work: Path) -> Result:
    """A 59 MiB header of 1.14 M zero-size entries (the probe's 63 MiB one stalled the event
    loop 6.8 s and kept 1 GB)."""
    path = _bombed(target, work, "bomb.safetensors")
    size = (path / "bomb.safetensors").stat().st_size
    info, took = _load_once(target, path, "header-bomb")
    how = f"{_code(info)} in {took * 1e3:.0f} ms ({size >> 20} MiB header)"
    return 1, int(info["state"] == "failed"), how


def entry_bomb(target: Target, work: Path) -> Result:
    """200,000 zero-size entries in 15 MiB, within the header's byte limit."""
    path = _bombed(target, work, "entries.safetensors")
    info, took = _load_once(target, path, "entry-bomb")
    return 1, int(info["state"] == "failed"), f"{_code(info)} in {took * 1e3:.0f} ms"


def odd_name(target: Target, work: Path) -> Result:
    """A checkpoint behind a directory named with bytes that are not UTF-8, then 100 reads of
    every view (they answered 500 until the model was deleted)."""
    odd = linked_copy(work, target.model, os.fsdecode(b"odd-\xff\xfe"))
    link = work / "odd-link"
    if not link.is_symlink():
        link.symlink_to(odd)
    with httpx.Client(base_url=target.url, timeout=60) as client:
        r = client.post("/v1/models", json={"path": str(link), "id": "odd"})
        if r.status_code == 202:
            _settled(client, "odd")
        answered = sum(
            client.get(view).status_code < 500
            for _ in range(25)
            for view in ("/v1/models", "/v1/inventory", "/v1/models/odd", "/metrics")
        )
        client.delete("/v1/models/odd")
    return 100, answered, "views answered (not 500)"


def load_flood(target: Target, work: Path) -> Result:
    """300 POSTs of loads of the tiny demo checkpoint from 16 threads (they started 305
    threads and held 1,521 files; a small model, so that accepted loads cannot fill memory)."""
    src = work / "flood-tiny"
    if not (src / "config.json").is_file():
        write_demo_checkpoint(src, "fp8", "tiny")

    local = threading.local()
    peak_threads = 0

    def post(i: int) -> int:
        nonlocal peak_threads
        if not hasattr(local, "client"):  # one client per attacking thread: the attacker's
            local.client = httpx.Client(base_url=target.url, timeout=60)  # CPU is not the case
        r = local.client.post("/v1/models", json={"path": str(src), "id": f"flood-{i}"})
        peak_threads = max(peak_threads, len(os.listdir(f"/proc/{target.pid}/task")))
        return int(r.status_code)

    with ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(post, range(300)))
    with httpx.Client(base_url=target.url, timeout=600) as client:
        for i, status in enumerate(statuses):
            if status == 202:
                _settled(client, f"flood-{i}")
                client.delete(f"/v1/models/flood-{i}")
    refused = sum(s == 429 for s in statuses)
    accepted = statuses.count(202)
    how = (
        f"{accepted} accepted, {refused} refused 429, the daemon's threads peaked at {peak_threads}"
    )
    return 300, refused, how


def _swap_files(weights: Path, good: Path, target: Path, stop: Any) -> None:
    """The attacker: swap ``weights`` between a hard link of the inside file and a symlink to
    the outside one, as fast as it can, until ``stop`` is set."""
    link = weights.with_name("swap.tmp")
    for i in range(100_000_000):
        if i % 256 == 0 and stop.is_set():
            return
        link.unlink(missing_ok=True)
        link.symlink_to(target) if i % 2 else os.link(good, link)
        os.replace(link, weights)


def symlink_race(target: Target, work: Path) -> Result:
    """40 loads of a checkpoint whose weights an attacking process (a core of its own) keeps
    swapping for a symlink out of the root; the loads are driven over one kept-alive client."""
    inside = linked_copy(work, target.model, "race")
    weights = inside / "model.safetensors"
    good = inside / "good.bin"
    os.link(weights, good)
    expected = checkpoint_fingerprint(inside).digest
    outside = work.parent / "outside-of-root"
    outside.mkdir(exist_ok=True)
    decoy = outside / "model.safetensors"
    shutil.copyfile(weights, decoy)
    rewrite_header(decoy, lambda h: h.update({"__metadata__": {"origin": "outside"}}))
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    attacker = ctx.Process(target=_swap_files, args=(weights, good, decoy, stop), daemon=True)
    attacker.start()
    held = 0
    outcomes: dict[str, int] = {}
    try:
        with httpx.Client(base_url=target.url, timeout=60) as client:
            for i in range(40):
                r = client.post("/v1/models", json={"path": str(inside), "id": f"r{i}"})
                if r.status_code != 202:
                    outcome = f"refused {r.json()['code']}"
                    held += r.json()["code"] == "path_not_allowed"
                else:
                    info = _settled(client, f"r{i}")
                    ok = info["state"] == "failed" and _code(info) == "path_not_allowed"
                    inside_file = info.get("fingerprint") == expected
                    held += ok or inside_file
                    outcome = (
                        f"failed {_code(info)}"
                        if info["state"] == "failed"
                        else ("loaded the inside file" if inside_file else "loaded ANOTHER file")
                    )
                    client.delete(f"/v1/models/r{i}")
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
    finally:
        stop.set()
        attacker.join(10)
        if attacker.is_alive():
            attacker.kill()
    how = ", ".join(f"{n} {what}" for what, n in sorted(outcomes.items()))
    return 40, held, f"never the outside file ({how})"


def many_layers_storm(target: Target, work: Path) -> Result:
    """A 5.4 MB checkpoint of 60,000 layers, one zero-size tensor each, loaded four at once
    and again as each fails, for 30 s (one load took 3.6 s and 169 MB; the storm took the
    daemon from 260 to 956 MB and kept 700-880 MB)."""
    return _storm(target, many_layers(work / "many-layers", target.model, 60_000))


def hollow_layers_storm(target: Target, work: Path) -> Result:
    """9,000 layers whose every linear weight is named, each of zero size (5.8 MB, 63,000
    entries: it passes every count and is parsed in full), loaded the same way."""
    return _storm(target, hollow_layers(work / "hollow-layers", target.model, 9_000))


def _storm(target: Target, path: Path) -> Result:
    """``path`` loaded four at once, again as each fails, for 30 s."""
    deadline = time.monotonic() + 30
    took: list[float] = []
    codes: dict[str, int] = {}
    lock = threading.Lock()

    def loader(n: int) -> None:
        i = 0
        while time.monotonic() < deadline:
            info, seconds = _load_once(target, path, f"{path.name}-{n}-{i}")
            i += 1
            with lock:
                took.append(seconds)
                codes[_code(info)] = codes.get(_code(info), 0) + 1

    threads = [threading.Thread(target=loader, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    refused = sum(n for code, n in codes.items() if code != "ready")
    mean = sum(took) / max(1, len(took))
    return len(took), refused, f"{codes}, {mean:.2f} s per load"
