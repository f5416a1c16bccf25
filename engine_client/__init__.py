"""weight-cache engine side: lease processed weights from the daemon, verify them, rebuild them
zero-copy, and plug into vLLM as the ``weight_cache`` load format."""
