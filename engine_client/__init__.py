"""weight-cache engine side: lease processed weights from the daemon, verify them, rebuild them
zero-copy, and plug into vLLM as the ``weight_cache`` load format."""

from engine_client.client import AsyncDaemonClient, ClientConfig, DaemonClient

__all__ = ["AsyncDaemonClient", "ClientConfig", "DaemonClient"]
