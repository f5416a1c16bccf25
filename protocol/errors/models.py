"""The models the daemon holds and the memory behind them: unknown, taken, in use, failed,
still loading, over budget, or their arenas lost or written to."""

from __future__ import annotations

from protocol.errors.base import WeightCacheError
from protocol.errors.requests import NotFoundError


class ModelNotFoundError(NotFoundError):
    code = "model_not_found"
    title = "Unknown model"
    hint = "list the models with GET /v1/models (or `weight-cache status`)"


class ConflictError(WeightCacheError):
    """The request is well formed but a model's state refuses it: the base of the conflicts."""

    code = "conflict"
    status = 409
    title = "Conflict"
    hint = ""


class ModelExistsError(ConflictError):
    code = "model_exists"
    title = "A model with this id is already registered"
    hint = (
        "unload it first with DELETE /v1/models/{id} (a failed load stays registered until "
        "then), or pick another id"
    )


class ModelInUseError(ConflictError):
    code = "model_in_use"
    title = "Model has active leases"
    hint = "release its leases, or wait for them to expire, then unload"


class ModelFailedError(ConflictError):
    code = "model_failed"
    title = "Model failed to load"
    hint = (
        "read `error` in GET /v1/models/{id}, fix the checkpoint, then unload it (DELETE) and "
        "load it again"
    )


class LayoutMismatchError(ConflictError):
    """Kernel, format or TP layout asked for differs from what the daemon processed for."""

    code = "layout_mismatch"
    title = "Requested layout differs from the processed one"
    hint = "ask for kernel `cutlass`, format `default` and the model's TP size"


class ModelLoadingError(WeightCacheError):
    code = "model_loading"
    status = 503
    title = "Model is still loading"
    hint = "retry after `Retry-After` seconds, or set the loader's `wait`"


class InsufficientMemoryError(WeightCacheError):
    code = "insufficient_memory"
    status = 507
    title = "Not enough memory within the budget"
    hint = "raise --memory-budget, or unload models"


class ArenaLostError(WeightCacheError):
    """A model's shared-memory arena file was removed or replaced under the daemon: the model
    is failed with this error, and no lease names the file again."""

    code = "arena_lost"
    status = 409
    title = "The model's arena file was removed or replaced"
    hint = (
        "unload the model (DELETE /v1/models/{id}) and load it again; keep /dev/shm cleaners "
        "away from the daemon's files"
    )


class ArenaCorruptedError(WeightCacheError):
    """A resident arena's bytes no longer match the checksums taken when it was written."""

    code = "arena_corrupted"
    status = 409
    title = "Resident weights changed after loading"
    hint = (
        "something wrote into the arena: unload the model (DELETE) and load it again, and find "
        "the writer"
    )


class ShmDirError(WeightCacheError):
    """The shared-memory arena directory is not safe to use (not ours, not a directory)."""

    code = "shm_dir_unsafe"
    status = 500
    title = "Unsafe shared-memory directory"
    hint = "give the daemon a --shm-dir it owns (a directory, not a link)"


class CudaDriverError(WeightCacheError):
    """A call into the CUDA driver (``cuda-bindings``) failed; ``call`` and ``result`` name it."""

    code = "cuda_driver_error"
    status = 500
    title = "A CUDA driver call failed"
    hint = (
        "check the GPU driver and that cuda-bindings is installed (the package's cuda extra: "
        "pip install 'cuda-bindings>=13.0,<14'), or start the daemon with --cuda-handles ipc"
    )


class KeeperUnavailableError(WeightCacheError):
    """No keeper answers on the run directory's socket (``--keeper external``), or it serves
    another daemon."""

    code = "keeper_unavailable"
    status = 503
    title = "No keeper for this daemon"
    hint = (
        "a keeper serves one daemon: stop the daemon that holds it, or give this one a "
        "--run-dir of its own (WEIGHT_CACHE_RUN_DIR); with --keeper external, start "
        "`weight-cache keeper` on the same --run-dir first"
    )


class TooManyModelsError(WeightCacheError):
    code = "too_many_models"
    status = 429
    title = "Too many models registered"
    hint = (
        "unload models you no longer need, failed ones included (DELETE /v1/models/{id}; "
        "--max-models raises the cap)"
    )


class TooManyLoadsError(WeightCacheError):
    code = "too_many_loads"
    status = 429
    title = "Too many loads at once"
    hint = (
        "retry after `Retry-After` seconds, once a load has finished (--max-concurrent-loads "
        "raises the cap)"
    )
