"""Checkpoints that cannot be served as they are: not found, not ModelOpt FP8, inconsistent,
corrupt, or files the daemon will not or cannot read. ``file``/``tensor`` say where."""

from __future__ import annotations

from protocol.errors.base import WeightCacheError


class CheckpointError(WeightCacheError):
    """A checkpoint cannot be served as it is: the family's base, raised as such only where no
    narrower code fits (too many weight files)."""

    code = "invalid_checkpoint"
    status = 422
    title = "Invalid checkpoint"
    hint = ""


class CheckpointNotFoundError(CheckpointError):
    code = "checkpoint_not_found"
    status = 404
    title = "Checkpoint not found"
    hint = (
        "check the path (a directory with config.json); for a Hugging Face repo id, download it "
        "first (`huggingface-cli download ORG/NAME`)"
    )


class NotModelOptCheckpointError(CheckpointError):
    code = "not_modelopt_checkpoint"
    title = "Not a ModelOpt checkpoint"
    hint = "use a ModelOpt FP8 export (hf_quant_config.json)"


class UnsupportedQuantAlgoError(CheckpointError):
    code = "unsupported_quant_algo"
    title = "Unsupported quantization algorithm"
    hint = "serve it with vLLM's own loader"


class UnsupportedArchitectureError(CheckpointError):
    code = "unsupported_architecture"
    title = "Unsupported architecture"
    hint = "serve it with vLLM's own loader"


class InvalidConfigError(CheckpointError):
    code = "invalid_config"
    title = "Invalid model or quantization config"
    hint = "fix the checkpoint's config.json, quantization config or index"


class TensorParallelError(CheckpointError):
    code = "tp_unsupported"
    title = "Tensor-parallel size does not divide the model"
    hint = "choose a TP size that divides the heads, KV heads and MLP"


class MissingTensorError(CheckpointError):
    code = "missing_tensor"
    title = "Missing tensor"
    hint = "re-export or re-download the checkpoint"


class TensorDtypeError(CheckpointError):
    code = "wrong_dtype"
    title = "Tensor has the wrong dtype"
    hint = "re-export the checkpoint"


class TensorShapeError(CheckpointError):
    code = "shape_mismatch"
    title = "Tensor shape does not match the config"
    hint = "re-export the checkpoint"


class InvalidScaleError(CheckpointError):
    code = "invalid_scale"
    title = "Non-finite, zero or negative scale"
    hint = "re-export the checkpoint"


class CorruptFileError(CheckpointError):
    code = "corrupt_safetensors"
    title = "Truncated or corrupt safetensors file"
    hint = "re-download the named file"


class PermissionDeniedError(CheckpointError):
    """The daemon's user may not read a checkpoint file: not corruption, and re-downloading as
    the same user would not help."""

    code = "permission_denied"
    status = 403
    title = "Checkpoint file not readable by the daemon"
    hint = (
        "make the named file readable by the daemon's user (uid 10001 in the image), e.g. "
        "`chmod a+r FILE`"
    )


class CheckpointUnreadableError(CheckpointError):
    code = "checkpoint_unreadable"
    title = "Checkpoint file cannot be read"
    hint = "check the file's permissions and the disk it lies on"


class NotRegularFileError(CheckpointError):
    """A checkpoint file that is a FIFO, socket, device or directory: never read from."""

    code = "not_regular_file"
    title = "Checkpoint file is not a regular file"
    hint = "point at a regular file (not a FIFO, socket, device or directory)"


class SymlinkRefusedError(CheckpointError):
    """A symlink loop, or a symlink where the path policy forbids them; ``reason`` says which."""

    code = "symlink_refused"
    title = "Symlink loop or forbidden symlink"
    hint = (
        "replace the symlink loop or the forbidden symlink with the real file (or start the "
        "daemon with WEIGHT_CACHE_FOLLOW_SYMLINKS=true)"
    )


class PathTooLongError(CheckpointError):
    code = "path_too_long"
    title = "Path or path component too long"
    hint = "use a shorter path"
