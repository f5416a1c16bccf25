"""Why an engine did not attach: the one closed list of fallback reasons.

Every failure between asking for a lease and a bound model ends as exactly one of these, whatever
raised it (the HTTP client, verification, opening the arena, rebuilding views, binding into
vLLM). The reason is what the engine logs, what ``weight_cache_engine_fallbacks_total{reason}``
counts, and what the operator's troubleshooting table lists.
"""

from __future__ import annotations

import enum


class Reason(str, enum.Enum):
    # Reaching the daemon and reading its answers.
    daemon_unavailable = "daemon_unavailable"
    unauthorized = "unauthorized"
    bad_response = "bad_response"  # an answer that is not the API's JSON
    daemon_error = "daemon_error"  # any other refusal the daemon reported
    model_not_found = "model_not_found"
    model_loading = "model_loading"
    model_failed = "model_failed"  # includes a model whose arena was lost (arena_lost)
    layout_mismatch = "layout_mismatch"
    daemon_restarted = "daemon_restarted"
    lease_expired = "lease_expired"
    # The engine's own side of the match.
    not_local_checkpoint = "not_local_checkpoint"
    checkpoint_unreadable = "checkpoint_unreadable"
    pipeline_parallel = "pipeline_parallel"
    # Verification of the grant against what the engine would have built.
    protocol_version = "protocol_version"
    device_mismatch = "device_mismatch"
    capability_mismatch = "capability_mismatch"
    kernel_mismatch = "kernel_mismatch"
    format_mismatch = "format_mismatch"
    quant_algo_mismatch = "quant_algo_mismatch"
    scheme_mismatch = "scheme_mismatch"
    unsupported_layer = "unsupported_layer"
    fingerprint_mismatch = "fingerprint_mismatch"
    tp_mismatch = "tp_mismatch"
    manifest_invalid = "manifest_invalid"
    checksum_mismatch = "checksum_mismatch"
    # Using the lease.
    arena_unavailable = "arena_unavailable"  # the shared-memory file is gone or unreadable
    ipc_open_failed = "ipc_open_failed"  # CUDA refused the IPC handle (or the descriptor)
    handle_refused = "handle_refused"  # the daemon's handle socket refused this process
    rebuild_failed = "rebuild_failed"  # a view the manifest describes cannot be made
    bind_failed = "bind_failed"  # vLLM's model disagreed with the lease
    unsupported_module = "unsupported_module"  # vLLM built a tensor neither side provides
    leased_read_only = "leased_read_only"  # an in-place reload of shared, leased weights
    # Donated models (a checkpoint the daemon does not process).
    donation_differs = "donation_differs"  # a donated model of this checkpoint, another key
    donation_refused = "donation_refused"  # the daemon would not take this engine's donation
    donation_unsupported = "donation_unsupported"  # processing left state outside tensors
    # Waiting, parked, to be released.
    park_timeout = "park_timeout"  # released by nobody within the loader's park_timeout
    park_cancelled = "park_cancelled"  # an operator cancelled the parked engine
    internal_error = "internal_error"  # an unexpected exception: a bug, logged with its type

    def __str__(self) -> str:  # as enum.StrEnum (Python 3.11+) prints: the value
        return str(self.value)

    @classmethod
    def parse(cls, value: object, default: Reason) -> Reason:
        """``value`` as a reason, or ``default`` for anything not on the list."""
        try:
            return cls(str(value))
        except ValueError:
            return default
