"""What the keeper holds: a model's descriptors only once the model is put, replaced ones
closed, dropped ones closed, and on a clear every descriptor closed and (without a daemon) the
shared-memory files it kept removed."""

from __future__ import annotations

import os
from pathlib import Path

from service.keeper.messages import KeptArena, KeptModel
from service.keeper.state import KeeperState


def kept(model_id: str, ranks: int, shm_dir: Path | None = None) -> KeptModel:
    from protocol.schemas.manifest import CheckpointDigests, CheckpointIdentity

    digests = CheckpointDigests(files="f", sampled="s", hf_blob=None, full=None)
    return KeptModel(
        id=model_id,
        path="/m",
        tp_size=ranks,
        checkpoint=CheckpointIdentity(
            path="/m",
            fingerprint="s",
            digests=digests,
            architecture="A",
            quant_algo="FP8",
            kv_cache_quant_algo=None,
        ),
        load_seconds=1.0,
        manifests=["{}"] * ranks,
        arenas=[
            KeptArena(
                rank=r,
                kind="shm",
                nbytes=8,
                allocation_size=8,
                boot_id="b",
                shm_name=f"a{r}" if shm_dir else None,
                shm_dir=str(shm_dir) if shm_dir else None,
                digest=None,
            )
            for r in range(ranks)
        ],
    )


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_descriptors_are_held_put_replaced_and_dropped(tmp_path: Path) -> None:
    state = KeeperState()
    files = [os.open(tmp_path / f"f{i}", os.O_CREAT | os.O_RDWR) for i in range(3)]
    state.put_fd(("m", 0), files[0])
    state.put_fd(("m", 1), files[1])
    state.put_model(kept("m", 2))
    assert state.fds == {("m", 0): files[0], ("m", 1): files[1]} and not state.pending
    state.put_fd(("m", 0), files[2])
    state.put_model(kept("m", 1))  # the model again, one rank: the earlier descriptors go
    assert state.fds == {("m", 0): files[2]}
    assert not is_open(files[0]) and not is_open(files[1])
    state.drop_model("m")
    assert state.fds == {} and state.models == {} and not is_open(files[2])


def test_a_model_without_all_its_descriptors_is_not_kept(tmp_path: Path) -> None:
    state = KeeperState()
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_RDWR)
    state.put_fd(("m", 0), fd)
    state.put_model(kept("m", 2))
    assert state.models == {} and state.fds == {} and not is_open(fd)


def test_clear_removes_the_files_it_kept_alone(tmp_path: Path) -> None:
    state = KeeperState()
    (tmp_path / "a0").write_bytes(b"x" * 8)
    (tmp_path / "other").write_bytes(b"y")
    state.put_fd(("m", 0), os.open(tmp_path / "a0", os.O_RDWR))
    state.put_model(kept("m", 1, tmp_path))
    (tmp_path / "a0").rename(tmp_path / "moved")
    (tmp_path / "a0").write_bytes(b"not the kept file")
    state.clear(remove_files=True)
    assert (tmp_path / "a0").exists()  # another file at that name now: left alone
    state.put_fd(("m", 0), os.open(tmp_path / "a0", os.O_RDWR))
    state.put_model(kept("m", 1, tmp_path))
    state.clear(remove_files=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["moved", "other"]
