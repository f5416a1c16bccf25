"""One exception hierarchy for the daemon and the engine side.

Every class is one failure mode with a stable ``code`` (what clients switch on, listed in the
operator's troubleshooting table) and the HTTP ``status`` the API answers with. The daemon turns
an instance into ``application/problem+json``; the engine-side client turns such a body back into
the same class through :func:`error_from_problem`, so both sides raise the same types.
"""

from __future__ import annotations

from typing import Any, ClassVar

from protocol.reasons import Reason

_REGISTRY: dict[str, type[WeightCacheError]] = {}


class WeightCacheError(Exception):
    """Base of every error weight-cache raises on purpose."""

    code: ClassVar[str] = "internal_error"
    status: ClassVar[int] = 500
    title: ClassVar[str] = "Internal error"

    def __init__(self, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        # JSON-serialisable context (file, tensor, mismatching fields, reason code...).
        self.extra: dict[str, Any] = {k: v for k, v in extra.items() if v is not None}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "code" in cls.__dict__:
            _REGISTRY[cls.code] = cls

    def __str__(self) -> str:
        context = ", ".join(f"{k}={v}" for k, v in self.extra.items() if k != "reason")
        return f"[{self.code}] {self.detail}" + (f" ({context})" if context else "")

    @property
    def hint(self) -> str:
        """What to do about it (the troubleshooting table's last column)."""
        return HINTS.get(self.code, "")

    def explain(self, cli: bool = False) -> str:
        """One line for an operator: the error and what to do; ``cli`` words the advice for a
        user of the ``weight-cache`` command rather than of the HTTP API."""
        hint = (CLI_HINTS.get(self.code) if cli else None) or self.hint
        return f"{self}: {hint}" if hint else str(self)

    def problem_fields(self) -> dict[str, Any]:
        """The body of the problem document, before the schema wraps it."""
        return {
            "type": f"urn:weight-cache:problem:{self.code}",
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
            "code": self.code,
            **({"hint": self.hint} if self.hint else {}),
            **self.extra,
        }


_REGISTRY[WeightCacheError.code] = WeightCacheError


def error_from_problem(body: dict[str, Any], status: int) -> WeightCacheError:
    """Rebuild the typed error a daemon reported; unknown codes keep their text."""
    code = str(body.get("code", ""))
    cls = _REGISTRY.get(code)
    detail = str(body.get("detail") or body.get("title") or f"HTTP {status}")
    reserved = {"type", "title", "status", "detail", "code", "hint"}
    extra = {k: v for k, v in body.items() if k not in reserved}
    if cls is None:
        err = WeightCacheError(detail, http_status=status, remote_code=code or None, **extra)
        return err
    return cls(detail, **extra)


# --- Checkpoints -------------------------------------------------------------------------------


class CheckpointError(WeightCacheError):
    """A checkpoint cannot be served as it is; ``file``/``tensor`` say where."""

    code = "invalid_checkpoint"
    status = 422
    title = "Invalid checkpoint"


class CheckpointNotFoundError(CheckpointError):
    code = "checkpoint_not_found"
    status = 404
    title = "Checkpoint not found"


class NotModelOptCheckpointError(CheckpointError):
    code = "not_modelopt_checkpoint"
    title = "Not a ModelOpt checkpoint"


class UnsupportedQuantAlgoError(CheckpointError):
    code = "unsupported_quant_algo"
    title = "Unsupported quantization algorithm"


class UnsupportedArchitectureError(CheckpointError):
    code = "unsupported_architecture"
    title = "Unsupported architecture"


class InvalidConfigError(CheckpointError):
    code = "invalid_config"
    title = "Invalid model or quantization config"


class MissingTensorError(CheckpointError):
    code = "missing_tensor"
    title = "Missing tensor"


class TensorDtypeError(CheckpointError):
    code = "wrong_dtype"
    title = "Tensor has the wrong dtype"


class TensorShapeError(CheckpointError):
    code = "shape_mismatch"
    title = "Tensor shape does not match the config"


class InvalidScaleError(CheckpointError):
    code = "invalid_scale"
    title = "Non-finite, zero or negative scale"


class CorruptFileError(CheckpointError):
    code = "corrupt_safetensors"
    title = "Truncated or corrupt safetensors file"


class TensorParallelError(CheckpointError):
    code = "tp_unsupported"
    title = "Tensor-parallel size does not divide the model"


# --- Requests ------------------------------------------------------------------------------------


class InvalidRequestError(WeightCacheError):
    code = "invalid_request"
    status = 422
    title = "Invalid request"


class PayloadTooLargeError(InvalidRequestError):
    code = "payload_too_large"
    status = 413
    title = "Request body too large"


class UnauthorizedError(WeightCacheError):
    code = "unauthorized"
    status = 401
    title = "Missing or wrong bearer token"


class PathNotAllowedError(WeightCacheError):
    code = "path_not_allowed"
    status = 403
    title = "Path outside the allowed roots"


class NotFoundError(WeightCacheError):
    code = "not_found"
    status = 404
    title = "Not found"


class MethodNotAllowedError(WeightCacheError):
    code = "method_not_allowed"
    status = 405
    title = "Method not allowed on this path"


class ModelNotFoundError(NotFoundError):
    code = "model_not_found"
    title = "Unknown model"


class LeaseNotFoundError(NotFoundError):
    code = "lease_not_found"
    title = "Unknown or ended lease"


class ConflictError(WeightCacheError):
    code = "conflict"
    status = 409
    title = "Conflict"


class ModelExistsError(ConflictError):
    code = "model_exists"
    title = "A model with this id is already registered"


class ModelInUseError(ConflictError):
    code = "model_in_use"
    title = "Model has active leases"


class ModelFailedError(ConflictError):
    code = "model_failed"
    title = "Model failed to load"


class LayoutMismatchError(ConflictError):
    """Kernel, format or TP layout asked for differs from what the daemon processed for."""

    code = "layout_mismatch"
    title = "Requested layout differs from the processed one"


class ModelLoadingError(WeightCacheError):
    code = "model_loading"
    status = 503
    title = "Model is still loading"


class LeaseExpiredError(WeightCacheError):
    code = "lease_expired"
    status = 410
    title = "Lease expired"


class InsufficientMemoryError(WeightCacheError):
    code = "insufficient_memory"
    status = 507
    title = "Not enough memory within the budget"


# --- Engine side -----------------------------------------------------------------------------


class DaemonUnavailableError(WeightCacheError):
    code = "daemon_unavailable"
    status = 503
    title = "Daemon not reachable"


class DaemonRestartedError(WeightCacheError):
    code = "daemon_restarted"
    status = 409
    title = "Daemon restarted since the lease was granted"


class VerificationError(WeightCacheError):
    """The lease does not describe what this engine would have built; ``reason`` says which
    check failed (a :class:`~protocol.reasons.Reason`)."""

    code = "verification_failed"
    status = 409
    title = "Lease failed verification"

    @property
    def reason(self) -> Reason:
        return Reason.parse(self.extra.get("reason"), Reason.manifest_invalid)


# --- Engine side: using a lease, and the daemon losing what it lends --------------------------


class AttachError(WeightCacheError):
    """Attaching failed after the daemon answered (its answer, the arena, the views, binding);
    ``reason`` (a :class:`~protocol.reasons.Reason`) says at which step. Raised on the engine
    side only, where the foreign exception arose."""

    code = "attach_failed"
    status = 500
    title = "Attaching to the leased weights failed"

    @property
    def reason(self) -> Reason:
        return Reason.parse(self.extra.get("reason", self.code), Reason.internal_error)


class BadResponseError(AttachError):
    code = "bad_response"
    status = 502
    title = "The daemon's answer is not the API's JSON"


class ArenaUnavailableError(AttachError):
    code = "arena_unavailable"
    status = 503
    title = "The leased arena cannot be opened"


class IpcOpenError(ArenaUnavailableError):
    code = "ipc_open_failed"
    title = "CUDA refused the leased IPC handle"


class ArenaLostError(WeightCacheError):
    """A model's shared-memory arena file was removed or replaced under the daemon: the model
    is failed with this error, and no lease names the file again."""

    code = "arena_lost"
    status = 409
    title = "The model's arena file was removed or replaced"


# --- Added later (kept at the end) -------------------------------------------------------------


class PermissionDeniedError(CheckpointError):
    """The daemon's user may not read a checkpoint file: not corruption, and re-downloading as
    the same user would not help."""

    code = "permission_denied"
    status = 403
    title = "Checkpoint file not readable by the daemon"


# --- Hostile input and hostile hosts ------------------------------------------------------------


class NotRegularFileError(CheckpointError):
    """A checkpoint file that is a FIFO, socket, device or directory: never read from."""

    code = "not_regular_file"
    title = "Checkpoint file is not a regular file"


class SymlinkRefusedError(CheckpointError):
    """A symlink loop, or a symlink where the path policy forbids them; ``reason`` says which."""

    code = "symlink_refused"
    title = "Symlink loop or forbidden symlink"


class PathTooLongError(CheckpointError):
    code = "path_too_long"
    title = "Path or path component too long"


class CheckpointUnreadableError(CheckpointError):
    code = "checkpoint_unreadable"
    title = "Checkpoint file cannot be read"


class TooManyLeasesError(WeightCacheError):
    """The daemon's cap on active leases is reached; release or let leases expire first."""

    code = "too_many_leases"
    status = 429
    title = "Too many active leases"


class TooManyClientLeasesError(TooManyLeasesError):
    code = "too_many_client_leases"
    title = "Too many active leases for this client process"


class TooManyConnectionsError(WeightCacheError):
    code = "too_many_connections"
    status = 503
    title = "Too many open connections"


class HeadersTooLargeError(InvalidRequestError):
    code = "headers_too_large"
    status = 431
    title = "Request line and headers too large"


class RequestTimeoutError(InvalidRequestError):
    code = "request_timeout"
    status = 408
    title = "Request not received in time"


class ArenaCorruptedError(WeightCacheError):
    """A resident arena's bytes no longer match the checksums taken when it was written."""

    code = "arena_corrupted"
    status = 409
    title = "Resident weights changed after loading"


class ShmDirError(WeightCacheError):
    """The shared-memory arena directory is not safe to use (not ours, not a directory)."""

    code = "shm_dir_unsafe"
    status = 500
    title = "Unsafe shared-memory directory"


class MalformedRequestError(InvalidRequestError):
    """Bytes that do not parse as HTTP/1.1 at all."""

    code = "malformed_request"
    status = 400
    title = "Malformed HTTP request"


# --- Who may call, and whose leases ------------------------------------------------------------


class ForbiddenError(WeightCacheError):
    code = "forbidden"
    status = 403
    title = "Forbidden"


class PeerNotAllowedError(ForbiddenError):
    """Without a token, a loopback TCP peer of another user than the daemon's (and not root)."""

    code = "peer_not_allowed"
    title = "Local user not allowed without the token"


class ClientNotVisibleError(ForbiddenError):
    """A lease for a process the daemon cannot see (so could never reap)."""

    code = "client_not_visible"
    title = "Client process not visible to the daemon"


class ClientNotYoursError(ForbiddenError):
    """A lease for a process of another user than the caller's."""

    code = "client_not_yours"
    title = "Client process belongs to another user"


class LeaseNotYoursError(ForbiddenError):
    code = "lease_not_yours"
    title = "Lease held by another user"


class TooManyUserLeasesError(TooManyLeasesError):
    code = "too_many_user_leases"
    title = "Too many active leases for this user"


class TooManyModelsError(WeightCacheError):
    code = "too_many_models"
    status = 429
    title = "Too many models registered"


class TooManyLoadsError(WeightCacheError):
    code = "too_many_loads"
    status = 429
    title = "Too many loads at once"


# What to do about each code: sent as the problem document's ``hint``, printed by the CLI, and
# the last column of the README's troubleshooting table (a test keeps the three equal).
HINTS: dict[str, str] = {
    "invalid_request": "fix the request; `errors` lists the fields",
    "payload_too_large": "send a smaller body (the daemon's limit is --max-body-size)",
    "unauthorized": "send `Authorization: Bearer <token>` with the daemon's token",
    "path_not_allowed": "move the checkpoint below an allowed root, or start the daemon with "
    "--allowed-root DIR",
    "not_found": "see openapi.json for the routes",
    "method_not_allowed": "see openapi.json for the methods each route takes (`Allow`)",
    "model_not_found": "list the models with GET /v1/models (or `weight-cache status`)",
    "lease_not_found": "lease again",
    "lease_expired": "lease again, and renew within the TTL",
    "daemon_restarted": "lease again",
    "model_exists": "unload it first with DELETE /v1/models/{id} (a failed load stays registered "
    "until then), or pick another id",
    "model_in_use": "release its leases, or wait for them to expire, then unload",
    "model_failed": "read `error` in GET /v1/models/{id}, fix the checkpoint, then unload it "
    "(DELETE) and load it again",
    "layout_mismatch": "ask for kernel `cutlass`, format `default` and the model's TP size",
    "model_loading": "retry after `Retry-After` seconds, or set the loader's `wait`",
    "insufficient_memory": "raise --memory-budget, or unload models",
    "checkpoint_not_found": "check the path (a directory with config.json); for a Hugging Face "
    "repo id, download it first (`huggingface-cli download ORG/NAME`)",
    "not_modelopt_checkpoint": "use a ModelOpt FP8 export (hf_quant_config.json)",
    "unsupported_quant_algo": "serve it with vLLM's own loader",
    "unsupported_architecture": "serve it with vLLM's own loader",
    "invalid_config": "fix the checkpoint's config.json, quantization config or index",
    "missing_tensor": "re-export or re-download the checkpoint",
    "wrong_dtype": "re-export the checkpoint",
    "shape_mismatch": "re-export the checkpoint",
    "invalid_scale": "re-export the checkpoint",
    "corrupt_safetensors": "re-download the named file",
    "permission_denied": "make the named file readable by the daemon's user (uid 10001 in the "
    "image), e.g. `chmod a+r FILE`",
    "tp_unsupported": "choose a TP size that divides the heads, KV heads and MLP",
    "internal_error": "report it with the daemon's log, which holds the traceback",
    "daemon_unavailable": "start the daemon, or point the loader's `url` / `uds` at it",
    "verification_failed": "the engine falls back to an ordinary load; `reason` says why",
    "attach_failed": "the engine falls back to an ordinary load; `reason` says at which step",
    "bad_response": "check that the loader's `url` / `uds` points at the weight-cache daemon",
    "arena_unavailable": "run the engine in the daemon's IPC namespace and /dev/shm (compose: "
    "`ipc: service:daemon`); the engine falls back meanwhile",
    "ipc_open_failed": "run the engine on the daemon's GPU, in its PID and IPC namespaces",
    "not_regular_file": "point at a regular file (not a FIFO, socket, device or directory)",
    "symlink_refused": "replace the symlink loop or the forbidden symlink with the real file "
    "(or start the daemon with WEIGHT_CACHE_FOLLOW_SYMLINKS=true)",
    "path_too_long": "use a shorter path",
    "checkpoint_unreadable": "check the file's permissions and the disk it lies on",
    "too_many_leases": "release leases or let them expire (--max-leases raises the cap)",
    "too_many_client_leases": "release this process's leases (--max-leases-per-client raises "
    "the cap)",
    "too_many_connections": "retry; close idle connections (--max-connections raises the cap)",
    "headers_too_large": "send smaller headers",
    "request_timeout": "send the whole request within --request-timeout seconds",
    "arena_corrupted": "something wrote into the arena: unload the model (DELETE) and load it "
    "again, and find the writer",
    "shm_dir_unsafe": "give the daemon a --shm-dir it owns (a directory, not a link)",
    "malformed_request": "speak HTTP/1.1 to the daemon",
    "arena_lost": "unload the model (DELETE /v1/models/{id}) and load it again; keep /dev/shm "
    "cleaners away from the daemon's files",
    "forbidden": "ask the daemon's operator",
    "peer_not_allowed": "use the daemon's Unix socket (--uds; --socket-group opens it to a group), "
    "or send the daemon's token (--token-file); --trust-local-users opens loopback TCP to all",
    "client_not_visible": "lease over the daemon's Unix socket (--uds), which proves who you are, "
    "or run the engine in the daemon's PID namespace (compose: `pid: service:daemon`)",
    "client_not_yours": "send your own process id as client_pid",
    "lease_not_yours": "only the user that took a lease (or a token holder) may read, renew or "
    "release it",
    "too_many_user_leases": "release this user's leases (--max-leases-per-uid raises the cap)",
    "too_many_models": "unload models you no longer need, failed ones included (DELETE "
    "/v1/models/{id}; --max-models raises the cap)",
    "too_many_loads": "retry after `Retry-After` seconds, once a load has finished "
    "(--max-concurrent-loads raises the cap)",
}

# The same advice for a user of the ``weight-cache`` command, where it differs.
CLI_HINTS: dict[str, str] = {
    "unauthorized": "pass --token-file FILE, or set WEIGHT_CACHE_TOKEN_FILE or WEIGHT_CACHE_TOKEN",
    "daemon_unavailable": "start it (`weight-cache serve`), or point --url / --uds (or "
    "WEIGHT_CACHE_URL, WEIGHT_CACHE_HOST, WEIGHT_CACHE_PORT, WEIGHT_CACHE_UDS) at it",
}
