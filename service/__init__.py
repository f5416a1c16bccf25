"""weight-cache daemon: loads ModelOpt FP8 checkpoints once, processes them for CUTLASS, keeps
them resident and lends them to engines.

Only the checkpoint, processing, memory-codec, schema and error modules are imported by the
engine side; everything that needs FastAPI lives under ``service.api``.
"""

from service.version import PROTOCOL_VERSION, __version__

__all__ = ["PROTOCOL_VERSION", "__version__"]
