"""Wire schemas: the pydantic models both the daemon and the engine side speak."""
