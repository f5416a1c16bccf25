"""The ``weight-cache`` command as an operator runs it: a child process of this interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

CLI = [sys.executable, "-m", "weight_cache_cli"]


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120, check: bool = False
) -> subprocess.CompletedProcess[str]:
    """``weight-cache ARGS`` with ``env`` over this process's environment; its output, and the
    status it exited with (a failure raises only with ``check``)."""
    return subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=check,
        env={**os.environ, **(env or {})},
    )
