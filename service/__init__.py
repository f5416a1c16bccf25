"""weight-cache daemon: loads ModelOpt FP8 checkpoints once, processes them for CUTLASS, keeps
them resident and lends them to engines.

The wire contract both sides share lives in ``protocol``; everything that needs FastAPI lives
under ``service.api``. Nothing outside the daemon imports this package.
"""

from protocol.version import PROTOCOL_VERSION, __version__

__all__ = ["PROTOCOL_VERSION", "__version__"]
