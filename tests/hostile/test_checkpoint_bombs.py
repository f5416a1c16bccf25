"""Small files that promise a lot: a config whose layer count one empty tensor seems to back,
layers by the ten thousand of one empty tensor each, loaded several at once, again and again,
and safetensors headers of a million empty entries. Each is refused with its code at the cost of
what the headers hold (not of what they promise), before any plan is built, ``/health`` answers
throughout, and the daemon's RSS comes back within 50 MB once the case ends."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from harness.checkpoint_tools import hollow_layers, many_layers, rewrite_json, rewrite_tensors
from harness.hostile.memory import RssBack
from harness.hostile.probe import HealthProbe
from modelopt_fp8.checkpoint import Checkpoint
from modelopt_fp8.checkpoint.opened import MAX_WEIGHT_FILES
from modelopt_fp8.checkpoint.safetensors_files import MAX_HEADER_BYTES, MAX_TENSORS
from protocol.errors import CorruptFileError, InvalidConfigError
from tests.hostile.conftest import LIMITS, Hostile


def _empty_entries_file(path: Path, count: int) -> int:
    """A safetensors file whose header lists ``count`` zero-size tensors; its header's size."""
    entries = b",".join(
        b'"model.extra.%d":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}' % i
        for i in range(count)
    )
    header = b"{" + entries + b"}"
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    return len(header)


def _load_and_settle(hostile: Hostile, path: Path, model_id: str) -> dict:
    r = hostile.load(path, model_id)
    assert r.status_code == 202, r.text
    info = hostile.settled(model_id, timeout_s=120)
    hostile.unload(model_id)
    return info


def test_one_empty_tensor_does_not_back_a_lying_layer_count(hostile: Hostile) -> None:
    """num_hidden_layers 400,000 and one zero-size tensor named for layer 399,999 (130 KB: the
    probe's took 22 s of CPU and kept 1 GB): refused on opening, before any plan (the header is
    small enough to be parsed as it is, and what it lacks is named)."""
    path = hostile.checkpoint("layer-liar")
    rewrite_json(path / "config.json", lambda c: c.update(num_hidden_layers=400_000))
    rewrite_tensors(
        path, lambda t: t.update({"model.layers.399999.x": torch.zeros(0, dtype=torch.float32)})
    )
    with RssBack(hostile.daemon.process.pid), HealthProbe(hostile.url) as probe:
        info = _load_and_settle(hostile, path, "layer-liar")
    assert info["state"] == "failed"
    assert info["error"]["code"] == "invalid_config"
    assert "no tensor of layer 2" in info["error"]["detail"]
    probe.assert_answered()


def test_every_layer_needs_its_weights(hostile: Hostile) -> None:
    """Layers that exist only by a stray tensor each, however many the config promises: the
    headers cannot hold their linear weights, which their lengths show before they are read."""
    path = hostile.checkpoint("hollow-layers")
    layers = 5000
    rewrite_json(path / "config.json", lambda c: c.update(num_hidden_layers=layers))
    rewrite_tensors(
        path,
        lambda t: t.update(
            {f"model.layers.{i}.x": torch.zeros(0, dtype=torch.float32) for i in range(layers)}
        ),
    )
    with RssBack(hostile.daemon.process.pid), HealthProbe(hostile.url) as probe:
        info = _load_and_settle(hostile, path, "hollow-layers")
    assert info["error"]["code"] == "invalid_config"
    assert "bytes of safetensors headers, which hold" in info["error"]["detail"]
    probe.assert_answered()


def test_layers_of_one_empty_tensor_each_are_refused_before_any_plan(hostile: Hostile) -> None:
    """60,000 layers in 5.4 MB, one zero-size tensor each (one load took 3.6 s and 169 MB: 240,000
    linear specs were built before the first weight was looked for): the layers' linear weights
    could not fit in headers of that length, which is known before a byte of them is read."""
    path = many_layers(hostile.root / "many-layers", hostile.tiny, 60_000)
    with RssBack(hostile.daemon.process.pid), HealthProbe(hostile.url) as probe:
        info = _load_and_settle(hostile, path, "many-layers")
    assert info["error"]["code"] == "invalid_config"
    assert "bytes of safetensors headers, which hold" in info["error"]["detail"]
    probe.assert_answered()


@pytest.mark.parametrize(
    ("write", "layers"),
    [(many_layers, 60_000), (hollow_layers, 9_000)],
    ids=["one-tensor", "hollow"],
)
def test_a_storm_of_such_loads_gives_its_memory_back(
    hostile: Hostile, write: Callable[[Path, Path, int], Path], layers: int
) -> None:
    """Such checkpoints loaded as many at once as the daemon runs, 12 times: 60,000 layers of
    one tensor each (four at once for 30 s took the daemon from 260 to 956 MB and kept
    700-880 MB: each failed model kept its error's traceback, and with it every frame of the
    load), and 9,000 layers whose every weight is named (parsed in full, 63,000 entries, before
    their sizes are found wrong; such parses run one at a time): RSS comes back within 50 MB."""
    path = write(hostile.root / f"storm-{layers}", hostile.tiny, layers)
    at_once = int(LIMITS["WEIGHT_CACHE_MAX_CONCURRENT_LOADS"])
    with RssBack(hostile.daemon.process.pid), HealthProbe(hostile.url) as probe:
        for round_ in range(12 // at_once):
            ids = [f"storm-{layers}-{round_}-{i}" for i in range(at_once)]
            for model_id in ids:
                assert hostile.load(path, model_id).status_code == 202
            for model_id in ids:
                assert hostile.settled(model_id, timeout_s=120)["state"] == "failed"
            for model_id in ids:
                hostile.unload(model_id)
    probe.assert_answered()


def test_a_header_bomb_is_refused_by_its_length(hostile: Hostile) -> None:
    """A 63 MiB header of 1.14 M zero-size entries (it stalled the event loop 6.8 s and kept
    1 GB): refused from its 8-byte length alone, before a byte of it is parsed."""
    path = hostile.checkpoint("header-bomb")
    size = _empty_entries_file(path / "bomb.safetensors", 1_140_000)
    assert size > MAX_HEADER_BYTES
    with RssBack(hostile.daemon.process.pid), HealthProbe(hostile.url) as probe:
        info = _load_and_settle(hostile, path, "header-bomb")
    assert info["error"]["code"] == "corrupt_safetensors"
    assert "limit" in info["error"]["detail"]
    assert info["error"]["file"].endswith("bomb.safetensors")
    probe.assert_answered()


def test_a_header_of_too_many_entries_stops_at_the_bound(hostile: Hostile) -> None:
    """Within the byte limit, 200,000 empty entries: the header is parsed an entry at a time
    (the event loop runs between entries) and refused at the first entry past the bound."""
    path = hostile.checkpoint("entry-bomb")
    size = _empty_entries_file(path / "entries.safetensors", 200_000)
    assert size <= MAX_HEADER_BYTES
    with RssBack(hostile.daemon.process.pid), HealthProbe(hostile.url) as probe:
        info = _load_and_settle(hostile, path, "entry-bomb")
    assert info["error"]["code"] == "corrupt_safetensors"
    assert f"more than {MAX_TENSORS} tensors" in info["error"]["detail"]
    probe.assert_answered()


def test_a_checkpoint_of_too_many_files_is_refused_before_one_is_opened(
    tiny_fp8: Path, tmp_path: Path
) -> None:
    """Each file is a descriptor held while the load runs: past ``MAX_WEIGHT_FILES``, named by the
    index or lying in the directory, the checkpoint is refused from their names alone."""
    too_many = MAX_WEIGHT_FILES + 1
    indexed = Path(shutil.copytree(tiny_fp8, tmp_path / "indexed"))
    weight_map = {f"t{i}": f"shard-{i}.safetensors" for i in range(too_many)}
    (indexed / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(InvalidConfigError, match=f"names {too_many} files"):
        Checkpoint.open(indexed)
    listed = Path(shutil.copytree(tiny_fp8, tmp_path / "listed"))
    for i in range(MAX_WEIGHT_FILES):
        (listed / f"extra-{i}.safetensors").touch()
    with pytest.raises(InvalidConfigError, match=f"holds {too_many} .safetensors files"):
        Checkpoint.open(listed)


def test_headers_are_bounded_in_all_files_together(tiny_fp8: Path, copy_of) -> None:
    """Two files each within the per-file bound, over it together: refused from their
    lengths, before either header is read."""
    path = copy_of(tiny_fp8)
    half = MAX_HEADER_BYTES // 2 + 8
    for name in ("a.safetensors", "b.safetensors"):
        header = b"{}" + b" " * (half - 2)
        (path / name).write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(CorruptFileError, match="in all"):
        Checkpoint.open(path)
