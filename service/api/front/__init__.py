"""The HTTP front: uvicorn, with bounds a hostile client cannot push past, in small parts.

uvicorn's public options bound what they can: idle keep-alive connections close after
``timeout_keep_alive``, a shutdown waits at most ``timeout_graceful_shutdown`` for connections,
the listen backlog is ``backlog``, there is no access log and no WebSocket (``config``). What
they cannot bound is bounded by a subclass of uvicorn's httptools protocol (``uvicorn_protocol``,
the one module that touches uvicorn's internals, pinned to its version), which asks these parts:

- ``limits``: the numbers, from the settings, and where refusals are counted;
- ``admission``: who gets a connection at the cap (an idle one makes way, the longest idle
  first; 16 more are let in for ``/health`` and ``/ready`` alone);
- ``caller_shares``: requests in the daemon's hands, per caller (a user, or the token's
  holders), so that no caller holds every connection;
- ``framing``: what a request may spend on bytes that are not its body (headers, chunk
  framing, trailers), so tiny chunks are refused;
- ``deadline``: the timers (a request must arrive whole in time; an answer must drain; a
  refused request's remaining bytes are read and dropped only briefly);
- ``answers``: the problem documents the front writes itself; ``transport_ends``: a reset
  that leaves nothing queued for a client that does not read.
"""
