"""The package version and the wire protocol version, in one place for both sides."""

__version__ = "0.1.0"

# Bumped whenever a manifest field changes meaning; the engine refuses any other value.
PROTOCOL_VERSION = 1

# Where a daemon listens unless told otherwise (clients assume the same).
DEFAULT_PORT = 8470
