"""The wire contract the daemon and the engine share: schemas, errors and reasons, versions,
dtypes, tokens, the CUDA IPC and shared-memory handle codec, checksums and device identity.

It imports nothing else of the project, so either side can depend on it alone.
"""
