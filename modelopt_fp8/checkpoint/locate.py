"""Where a ``--model`` lives: a checkpoint directory, or a Hugging Face repo id found in the
local Hugging Face cache (offline: the daemon never downloads), as vLLM accepts either."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from protocol.errors import CheckpointNotFoundError
from protocol.hub_cache import repo_folder

# org/name as the Hub spells repo ids; a path that exists is always taken as a path.
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9._-]+$")


def hub_cache(environ: Mapping[str, str] | None = None) -> Path:
    """The cache huggingface_hub writes to, chosen by the same variables."""
    env = os.environ if environ is None else environ
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    base = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return base / "huggingface" / "hub"


def cached_snapshot(
    repo_id: str, environ: Mapping[str, str] | None = None, revision: str | None = None
) -> Path | None:
    """The snapshot of ``revision`` (a branch or tag the cache has a ref for, or a commit
    hash; default ``main``) in the local cache, if it was downloaded."""
    repo = hub_cache(environ) / repo_folder(repo_id)
    ref = revision or "main"
    try:
        commit = (repo / "refs" / ref).read_text(encoding="utf-8").strip()
    except (OSError, ValueError):
        commit = ref if revision else ""  # a commit hash names its snapshot directly
    if not commit or "/" in commit or commit in (".", ".."):
        return None
    snapshot = repo / "snapshots" / commit
    return snapshot if (snapshot / "config.json").is_file() else None


def local_checkpoint(
    spec: str, revision: str | None = None, environ: Mapping[str, str] | None = None
) -> Path | None:
    """The local directory a model name stands for, as vLLM resolves it without downloading:
    the directory itself, or a cached snapshot of a Hugging Face repo id; ``None`` if neither.
    The engine finds the checkpoint it compares a lease with this way."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if REPO_ID.match(spec) and not path.exists():
        return cached_snapshot(spec, environ, revision)
    return None


def locate_checkpoint(spec: str | Path, environ: Mapping[str, str] | None = None) -> Path:
    """The absolute checkpoint directory ``spec`` names (a directory, or a cached repo id), as
    :func:`local_checkpoint` finds it; where it finds none, why, typed."""
    text = str(spec)
    found = local_checkpoint(text, environ=environ)
    if found is not None:
        return found.resolve()
    path = Path(spec).expanduser()
    if REPO_ID.match(text) and not path.exists():
        raise CheckpointNotFoundError(
            f"{text} is neither a directory nor a Hugging Face repo in the local cache "
            f"{hub_cache(environ)}: download it first (`huggingface-cli download {text}`; "
            "HF_HOME or HF_HUB_CACHE choose the cache), or pass the checkpoint directory",
            file=text,
        )
    raise CheckpointNotFoundError(
        f"checkpoint directory {path.absolute()} does not exist", file=str(path.absolute())
    )
