"""The REST API: a FastAPI app over :class:`service.daemon.Daemon`, one router per resource."""
