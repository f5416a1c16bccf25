"""``make demo``: a real vLLM 0.33 engine on this machine's CPU attached to the demo model, then
the same engine with vLLM's default loader; prints both token lists and both model loads.

It writes the demo checkpoint, starts ``weight-cache serve`` on it (CPU twin, a run directory
and arenas of its own, no keeper), runs :mod:`harness.cpu_engine` twice, and stops the daemon.
If attaching fell back, the fallback's reason is the last line printed."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness.daemon_process import start_daemon
from service.demo import write_demo_checkpoint


def run_engine(checkpoint: Path, url: str | None, log: Path) -> dict[str, Any]:
    """One engine in its own process; its vLLM output goes to ``log``."""
    args = [sys.executable, "-m", "harness.cpu_engine", str(checkpoint), *([url] if url else [])]
    with log.open("wb") as out:
        done = subprocess.run(args, stdout=subprocess.PIPE, stderr=out, check=False)
    lines = done.stdout.decode().strip().splitlines()
    if done.returncode != 0 or not lines:
        sys.exit(f"the engine failed (exit {done.returncode}); its output: {log}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="weight-cache-demo-"))
    checkpoint = work / "demo"
    write_demo_checkpoint(checkpoint, "fp8", "tiny")
    print(f"demo checkpoint: {checkpoint}")
    daemon = start_daemon(work, [checkpoint], device="cpu", timeout_s=120)
    print(f"weight-cache serve: {daemon.url} (log {daemon.log})")
    try:
        print("vLLM 0.33 on the CPU, --load-format weight_cache ...", flush=True)
        attached = run_engine(checkpoint, daemon.url, work / "engine-weight-cache.log")
    finally:
        daemon.stop()
    print("vLLM 0.33 on the CPU, vLLM's default loader ...", flush=True)
    default = run_engine(checkpoint, None, work / "engine-default.log")
    print(f"weight_cache tokens: {attached['tokens']}")
    print(f"default tokens:      {default['tokens']}")
    print(f"tokens equal: {attached['tokens'] == default['tokens']}")
    print(f"weight_cache: Model loading took {attached['loading_s']:.6f} seconds")
    print(f"default:      Model loading took {default['loading_s']:.6f} seconds")
    print(f"engine logs: {work}")
    if attached["fallback"]:
        print(f"attach fell back: {attached['fallback']}")


if __name__ == "__main__":
    main()
