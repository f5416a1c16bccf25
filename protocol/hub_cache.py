"""How the Hugging Face cache spells a repo on disk (``models--Org--Name/snapshots/<revision>``),
both ways: the daemon finds a repo id's snapshot, and names a model after the repo a snapshot
belongs to."""

from __future__ import annotations

from pathlib import Path

_REPO_PREFIX = "models--"


def repo_folder(repo_id: str) -> str:
    """The cache folder of ``repo_id`` (``Org/Name`` -> ``models--Org--Name``)."""
    return _REPO_PREFIX + repo_id.replace("/", "--")


def snapshot_repo(snapshot: Path) -> str | None:
    """The cache's name for the repo ``snapshot`` belongs to (``Org--Name``), if it is a
    snapshot folder of the cache."""
    repo = snapshot.parent.parent.name
    if snapshot.parent.name == "snapshots" and repo.startswith(_REPO_PREFIX):
        return repo.removeprefix(_REPO_PREFIX)
    return None
