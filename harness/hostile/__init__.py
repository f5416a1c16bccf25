"""The hostile neighbour's tools: raw sockets, other local users, the attacks they run
(``attackers``: standard library alone, so a process dropped to another user can run them), a
lease holder asking while a neighbour trickles bytes, the daemon's memory around a case, probes
running beside it. The hostile tests assert with them; ``bench.hostile`` measures with them."""
