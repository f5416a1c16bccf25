"""Python code run in a child process of this interpreter, for what needs a fresh process: an
import measured cold, another user's view of a file, a process killed midway, vLLM's logging
configured from scratch."""

from __future__ import annotations

import os
import subprocess
import sys

STDERR_SHOWN = 4000  # characters of a failed child's stderr that the error carries


class PythonChildFailed(RuntimeError):
    """The child exited non-zero; the message ends with its stderr, which the caller would
    otherwise never see."""


def run_python(
    code: str,
    *args: str,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float = 120,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """``python -c CODE ARGS`` with ``env`` as its whole environment (``None``: this process's);
    its output as text. With ``check``, a non-zero exit raises :class:`PythonChildFailed`."""
    argv = [sys.executable, "-c", code, *args]
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, check=False, env=env, cwd=cwd
    )
    if check and done.returncode != 0:
        raise PythonChildFailed(
            f"python child exited {done.returncode}:\n{done.stderr[-STDERR_SHOWN:]}"
        )
    return done
