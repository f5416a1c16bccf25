"""Where a load over the API may read from: only below the allowed roots, checked on every file it
opens, and checked once more before the load is accepted so a refusal comes with its code at once.

Startup models (named by the operator on the command line) are read without this policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from modelopt_fp8.checkpoint.opened import CheckpointDir, PathPolicy
from modelopt_fp8.checkpoint.safetensors_files import INDEX_FILE
from protocol.errors import PathNotAllowedError

# The files of a checkpoint a load opens besides its shards.
CHECKPOINT_FILES = ("config.json", "hf_quant_config.json", INDEX_FILE)


def api_load_policy(allowed_roots: Sequence[Path], follow_symlinks: bool) -> PathPolicy | None:
    """The policy API loads read under; None when no root is allowed (API loads are off)."""
    return PathPolicy.below(list(allowed_roots), follow_symlinks) if allowed_roots else None


def allowed_checkpoint_path(path: Path, policy: PathPolicy | None) -> Path:
    """The real path of a checkpoint directory below an allowed root, after opening the
    files a load reads as the load will (so a FIFO, a symlink out of the roots or a loop
    is refused now, with its code); the load checks each file again as it opens it.
    Blocking filesystem work: call it off the event loop."""
    if policy is None:
        raise PathNotAllowedError(
            "loading over the API is disabled: start the daemon with --allowed-root",
            path=str(path),
        )
    opened = CheckpointDir.open(path, policy)
    try:
        names = [*CHECKPOINT_FILES, *opened.names(".safetensors")]
        for name in names:
            file = opened.open_file(name)
            if file is not None:
                file.close()
    finally:
        opened.close()
    return opened.real
