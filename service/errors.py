"""One exception hierarchy for the daemon and the engine side.

Every class is one failure mode with a stable ``code`` (what clients switch on, listed in the
operator's troubleshooting table) and the HTTP ``status`` the API answers with. The daemon turns
an instance into ``application/problem+json``; the engine-side client turns such a body back into
the same class through :func:`error_from_problem`, so both sides raise the same types.
"""

from __future__ import annotations

from typing import Any, ClassVar

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

    def problem_fields(self) -> dict[str, Any]:
        """The body of the problem document, before the schema wraps it."""
        return {
            "type": f"urn:weight-cache:problem:{self.code}",
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
            "code": self.code,
            **self.extra,
        }


_REGISTRY[WeightCacheError.code] = WeightCacheError


def error_from_problem(body: dict[str, Any], status: int) -> WeightCacheError:
    """Rebuild the typed error a daemon reported; unknown codes keep their text."""
    code = str(body.get("code", ""))
    cls = _REGISTRY.get(code)
    detail = str(body.get("detail") or body.get("title") or f"HTTP {status}")
    reserved = {"type", "title", "status", "detail", "code"}
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
    check failed (see ``engine_client.verify.Reason``)."""

    code = "verification_failed"
    status = 409
    title = "Lease failed verification"

    @property
    def reason(self) -> str:
        return str(self.extra.get("reason", "unknown"))


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
