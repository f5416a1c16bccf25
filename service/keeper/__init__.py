"""The keeper: a small process that holds the arenas' descriptors (and the shared-memory files)
and what a new daemon needs to take them over, so the weights outlive the daemon's process."""
