"""The ``vllm.general_plugins`` entry point: registers the ``weight_cache`` load format.

vLLM calls :func:`register` with no arguments once in every process that may build a loader.
It must never raise (vLLM would only log it), so a vLLM without the needed API is reported and
skipped. It also routes the project's log lines through vLLM's logging, so that an engine's
output says what the loader did (attached, donated, why it fell back) as vLLM's own lines do.
"""

from __future__ import annotations

from protocol.logsafe import get_logger

log = get_logger(__name__)


def register() -> None:
    try:
        import engine_client.vllm.loader  # noqa: F401  (registers the load format on import)
        from engine_client.vllm.internals import log_through_vllm
    except ImportError as exc:
        log.warning("weight-cache: vLLM loader not registered: %s", exc)
        return
    log_through_vllm()
