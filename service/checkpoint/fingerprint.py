"""The checkpoint fingerprint: one hash over config.json, hf_quant_config.json and every
safetensors header (which names, types, shapes and places every tensor).

Daemon and engine compute it with this one function from their own copies of the files, so a
lease is only used for the checkpoint the engine was asked to load. Reading headers only keeps it
cheap (milliseconds for an 8B model) while still changing whenever any tensor's layout does.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from service.checkpoint.opened import CheckpointDir
from service.checkpoint.safetensors_files import read_header, weight_files

CONFIG_FILES = ("config.json", "hf_quant_config.json")
_DOMAIN = b"weight-cache checkpoint fingerprint v1\0"


def _frame(h: hashlib._Hash, name: str, data: bytes) -> None:
    h.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)


def fingerprint_of(configs: dict[str, bytes], headers: dict[str, bytes]) -> str:
    """``sha256:<hex>`` of config bytes (file name -> bytes; absent files count as empty) and
    raw safetensors headers (file name -> bytes), as read through opened files."""
    h = hashlib.sha256(_DOMAIN)
    for name in CONFIG_FILES:
        _frame(h, name, configs.get(name, b""))
    for name in sorted(headers):
        _frame(h, name, headers[name])
    return "sha256:" + h.hexdigest()


def checkpoint_fingerprint(directory: Path, headers: dict[str, bytes] | None = None) -> str:
    """``sha256:<hex>`` of the configs and safetensors headers of ``directory``.

    ``headers`` (file name -> raw header bytes) spares re-reading them when the caller has them.
    """
    opened = CheckpointDir.open(directory)
    try:
        configs = {}
        for name in CONFIG_FILES:
            file = opened.open_file(name)
            if file is not None:
                try:
                    configs[name] = file.read_all()
                finally:
                    file.close()
        if headers is None:
            files, _ = weight_files(opened)
            try:
                headers = {f.name: read_header(f) for f in files}
            finally:
                for f in files:
                    f.close()
    finally:
        opened.close()
    return fingerprint_of(configs, headers)
