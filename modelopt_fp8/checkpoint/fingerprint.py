"""Checkpoint identity in tiers: is the engine's copy of a checkpoint the one the daemon loaded?

Daemon and engine compute every tier with these functions from their own copies of the files;
the daemon publishes its digests in the model record and every manifest, the engine compares the
one tier it chose. Each tier trades cost at engine start against what it catches:

- ``files``: device, inode, size and mtime_ns of every file. Free (a ``stat`` per file); the same
  files seen through a bind mount match, any copy (even byte-identical) does not.
- ``sampled`` (default): sizes, configs, safetensors headers and a few KiB of every tensor's data
  at fixed positions derived from its offset and size. Milliseconds; tells apart any two
  checkpoints whose tensors differ throughout (a fine-tune, a re-export, another seed), but not a
  change confined to bytes no sample covers.
- ``hf_blob``: the blob ids of a Hugging Face cache (``snapshots/<rev>/<file>`` links to
  ``blobs/<content hash>``). Free, exact for content as the Hub published it; only where both
  copies sit in such a cache, and blind to a blob edited in place.
- ``full``: xxh3-128 over every byte of every file (a hash of 64 MiB block hashes, so the
  cores hash blocks in parallel). Catches any changed byte; costs a full read of the checkpoint
  (the daemon pays it at the end of its load, an engine only when it opts in). xxh3 is chosen
  for speed (tens of GB/s per core): the threat is a wrong checkpoint, not a forged one.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import mmap
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import xxhash

from modelopt_fp8.checkpoint.opened import CheckpointDir, ReadFile
from modelopt_fp8.checkpoint.safetensors_files import INDEX_FILE, read_header, weight_files
from protocol.errors import CorruptFileError
from protocol.schemas.manifest import CheckpointDigests

_CONFIG_FILES = ("config.json", "hf_quant_config.json")
_DOMAIN = b"weight-cache checkpoint identity v2\0"
SAMPLE_BYTES = 1024  # per window
SAMPLE_WINDOWS = 4  # first, last and two at positions derived from the tensor's offset and size
_COALESCE_GAP = 64 << 10  # windows this close are read together
FULL_BLOCK = 64 << 20  # the full tier hashes blocks of this size in parallel
_MASK64 = (1 << 64) - 1


class IdentityTier(str, enum.Enum):
    files = "files"
    sampled = "sampled"
    hf_blob = "hf_blob"
    full = "full"

    def __str__(self) -> str:
        return str(self.value)


DEFAULT_TIER = IdentityTier.sampled


@dataclass(frozen=True)
class Fingerprint:
    """One copy's digest at one tier; ``digest`` is None where the tier does not apply to it
    (``hf_blob`` outside a Hugging Face cache)."""

    tier: IdentityTier
    digest: str | None

    def matches(self, digests: CheckpointDigests | None) -> bool:
        """Whether the daemon's published digests name this copy at this tier."""
        if digests is None or self.digest is None:
            return False
        return digests.of(self.tier.value) == self.digest


def _frame(h: hashlib._Hash, name: str, data: bytes) -> None:
    h.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)


def identity_files(
    directory: Path, weights: Iterable[Path], read: Mapping[str, ReadFile] | None = None
) -> list[Path]:
    """Every file a load reads: the configs, the shard index and the safetensors files
    (``read``: the small files a load read, by name; without it, those present)."""
    small = (*_CONFIG_FILES, INDEX_FILE)
    if read is not None:
        named = [directory / n for n in small if n in read]
    else:
        named = [directory / n for n in small if (directory / n).is_file()]
    return sorted({*named, *weights}, key=lambda p: p.name)


def files_digest(
    files: Iterable[Path],
    opened: dict[str, int] | None = None,
    read: Mapping[str, ReadFile] | None = None,
) -> str:
    """The ``files`` tier: sha256 over (name, st_dev, st_ino, size, mtime_ns) of every file
    (``opened``: file name -> the descriptor to ``fstat`` instead of the name; ``read``: the
    small files as read, with their ``fstat`` then)."""
    h = hashlib.sha256(_DOMAIN + b"files\0")
    for path in files:
        given = (opened or {}).get(path.name)
        kept = (read or {}).get(path.name)
        if kept is not None:  # as the load read it
            st = kept.stat
        elif given is not None:
            st = os.fstat(given)
        else:
            st = os.stat(path)
        fields = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        _frame(h, path.name, b"".join(v.to_bytes(16, "little", signed=True) for v in fields))
    return "sha256:" + h.hexdigest()


def hf_blob_digest(files: Iterable[Path]) -> str | None:
    """The ``hf_blob`` tier: sha256 over each file's name and Hugging Face blob id, or None
    when any file is not a link into a ``blobs/`` directory."""
    h = hashlib.sha256(_DOMAIN + b"hf_blob\0")
    for path in files:
        if not path.is_symlink():
            return None
        target = path.resolve()
        if target.parent.name != "blobs" or not target.is_file():
            return None
        _frame(h, path.name, target.name.encode())
    return "sha256:" + h.hexdigest()


def _mix(x: int) -> int:
    """splitmix64: spreads an integer over 64 bits (deterministic sample positions)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_windows(begin: int, end: int) -> list[tuple[int, int]]:
    """(offset, length) windows sampled from the tensor data at ``[begin, end)`` of its file:
    all of it when small, else its first and last bytes and windows at positions derived from
    its offset and size (the same on every copy of the same layout)."""
    size = end - begin
    if size <= SAMPLE_BYTES * SAMPLE_WINDOWS:
        return [(begin, size)] if size > 0 else []
    span = size - SAMPLE_BYTES
    inner = [
        begin + _mix(begin * 1_000_003 + size * 31 + i) % span for i in range(2, SAMPLE_WINDOWS)
    ]
    return [
        (begin, SAMPLE_BYTES),
        *((p, SAMPLE_BYTES) for p in inner),
        (end - SAMPLE_BYTES, SAMPLE_BYTES),
    ]


def _sample_file(h: hashlib._Hash, path: Path, raw_header: bytes, opened: int | None) -> None:
    """Hash the file's size, its header, then every sample window in file order. Windows close
    together are fetched with one read (a read costs more than the bytes it returns). ``opened``
    (a descriptor of the file, kept open by the caller) is read instead of the path, so the
    digest is of the file whose header was checked even if the name is swapped meanwhile."""
    header = json.loads(raw_header)
    data_start = 8 + len(raw_header)
    windows = sorted(
        window
        for name, entry in header.items()
        if name != "__metadata__"
        for window in sample_windows(
            data_start + entry["data_offsets"][0], data_start + entry["data_offsets"][1]
        )
    )
    fd = os.open(path, os.O_RDONLY) if opened is None else os.dup(opened)
    try:
        _frame(h, path.name, raw_header + os.fstat(fd).st_size.to_bytes(8, "little"))
        parts: list[bytes | memoryview] = []
        i, n = 0, len(windows)
        while i < n:
            start, length = windows[i]
            end, j = start + length, i + 1
            while j < n and windows[j][0] - end <= _COALESCE_GAP:
                end = max(end, windows[j][0] + windows[j][1])
                j += 1
            run = memoryview(os.pread(fd, end - start, start))
            if len(run) != end - start:
                raise ValueError(f"{path.name} is shorter than its header says")
            parts.extend(run[o - start : o - start + length] for o, length in windows[i:j])
            i = j
        h.update(b"".join(parts))
    finally:
        os.close(fd)


def sampled_digest(
    directory: Path,
    weights: list[Path],
    headers: dict[str, bytes],
    opened: dict[str, int] | None = None,
    read: Mapping[str, ReadFile] | None = None,
) -> str:
    """The ``sampled`` tier: sha256 over the configs, each safetensors file's size and header,
    and every tensor's sample windows (``headers``: file name -> raw header bytes; ``opened``:
    file name -> a descriptor to read it through)."""
    h = hashlib.sha256(_DOMAIN + b"sampled\0")
    for name in (*_CONFIG_FILES, INDEX_FILE):
        path = directory / name
        if read is not None:  # the small files as a load read them, never the names again
            kept = read.get(name)
            _frame(h, name, kept.data if kept is not None else b"")
        else:
            _frame(h, name, path.read_bytes() if path.is_file() else b"")
    for path in sorted(weights, key=lambda p: p.name):
        _sample_file(h, path, headers[path.name], (opened or {}).get(path.name))
    return "sha256:" + h.hexdigest()


def full_digest(
    files: Iterable[Path],
    between: Callable[[], None] | None = None,
    opened: dict[str, int] | None = None,
    executor: Executor | None = None,
    read: Mapping[str, ReadFile] | None = None,
) -> str:
    """The ``full`` tier: xxh3-128 over the xxh3-128 of every 64 MiB block of every file
    (names, sizes and the block size framed). The blocks are hashed in parallel (on
    ``executor``, else on a pool of this machine's cores), each straight from a read-only
    mapping (no copy); ``opened`` (file name -> descriptor) is read instead of the name, and
    ``read`` (small files as read whole) hashed from memory, so the digest is of the files that
    were checked. ``between`` runs as blocks complete (a load raises from it to stop
    hashing)."""
    paths = list(files)
    h = xxhash.xxh3_128(_DOMAIN + b"full\0" + FULL_BLOCK.to_bytes(8, "little"))
    maps: list[mmap.mmap | bytes | None] = []
    framed: list[bytes] = []
    futures: list[list[Future[bytes]]] = []
    pool = executor or ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="full-digest")
    try:
        for path in paths:
            size, mapped = _contents(
                path, (opened or {}).get(path.name), (read or {}).get(path.name)
            )
            maps.append(mapped)
            framed.append(path.name.encode() + b"\0" + size.to_bytes(8, "little"))
            futures.append(
                [
                    pool.submit(_block_digest, mapped, offset, min(FULL_BLOCK, size - offset))
                    for offset in range(0, size, FULL_BLOCK)
                    if mapped is not None
                ]
            )
        for frame, blocks in zip(framed, futures, strict=True):
            h.update(frame)
            for block in blocks:
                h.update(block.result())
                if between is not None:
                    between()
    finally:
        pending = [f for blocks in futures for f in blocks if not f.cancel()]
        wait(pending)  # no block still reads a mapping when it closes
        for mapped in maps:
            if isinstance(mapped, mmap.mmap):
                mapped.close()
        if executor is None:
            pool.shutdown()
    return "xxh3-128:" + h.hexdigest()


def _contents(
    path: Path, opened: int | None, read: ReadFile | None
) -> tuple[int, mmap.mmap | bytes | None]:
    """A file's size and bytes: as read, or a read-only mapping (None when empty) of its
    descriptor, or of its name when neither is given."""
    if read is not None:
        return len(read.data), read.data
    with _typed(path):
        fd = os.dup(opened) if opened is not None else os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            return size, mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if size else None
        finally:
            os.close(fd)  # the mapping keeps the file


def _block_digest(mapped: mmap.mmap | bytes, offset: int, nbytes: int) -> bytes:
    view = memoryview(mapped)[offset : offset + nbytes]
    try:
        return xxhash.xxh3_128_digest(view)
    finally:
        view.release()


def checkpoint_digests(
    directory: Path,
    weights: list[Path],
    headers: dict[str, bytes],
    opened: dict[str, int],
    read: Mapping[str, ReadFile],
) -> CheckpointDigests:
    """The cheap tiers of ``directory`` as a load opened it (``full`` is left to whoever reads
    every byte): its files through the descriptors and small files the load checked."""
    files = identity_files(directory, weights, read)
    with _typed(directory):
        return CheckpointDigests(
            files=files_digest(files, opened, read),
            sampled=sampled_digest(directory, weights, headers, opened, read),
            hf_blob=hf_blob_digest(files),
            full=None,
        )


def checkpoint_fingerprint(
    directory: Path, tier: IdentityTier = DEFAULT_TIER, headers: dict[str, bytes] | None = None
) -> Fingerprint:
    """This copy's digest at ``tier``, read from its files with the functions the daemon uses.
    ``headers`` (file name -> raw header bytes) spares re-reading them."""
    opened = CheckpointDir.open(directory)
    try:
        files, _ = weight_files(opened)
        try:
            weights = [f.path for f in files]
            if headers is None and tier is IdentityTier.sampled:
                headers = {f.name: read_header(f) for f in files}
        finally:
            for f in files:
                f.close()
    finally:
        opened.close()
    with _typed(directory):
        return _fingerprint(directory, weights, tier, headers)


@contextlib.contextmanager
def _typed(where: Path) -> Iterator[None]:
    """Unreadable files and headers that do not parse become the checkpoint's typed error."""
    try:
        yield
    except OSError as exc:
        raise CorruptFileError(
            f"cannot read: {exc.strerror or exc}", file=exc.filename or str(where)
        ) from exc
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise CorruptFileError(f"unreadable safetensors header: {exc}", file=str(where)) from exc


def _fingerprint(
    directory: Path, weights: list[Path], tier: IdentityTier, headers: dict[str, bytes] | None
) -> Fingerprint:
    if tier is IdentityTier.files:
        return Fingerprint(tier, files_digest(identity_files(directory, weights)))
    if tier is IdentityTier.hf_blob:
        return Fingerprint(tier, hf_blob_digest(identity_files(directory, weights)))
    if tier is IdentityTier.full:
        return Fingerprint(tier, full_digest(identity_files(directory, weights)))
    assert headers is not None, "the sampled tier reads the headers first"
    return Fingerprint(tier, sampled_digest(directory, weights, headers))
