"""The hostile neighbour's tools: raw sockets, other local users, the daemon's memory around a
case, a ``/health`` probe running beside it. The hostile tests assert with them; ``bench.hostile``
measures with them."""
