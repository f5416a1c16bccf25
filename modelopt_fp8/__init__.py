"""Reading ModelOpt FP8 checkpoints and processing them exactly as vLLM 0.33 does: the library
the daemon loads with and the engine's fallback reads from disk with.

It imports ``protocol`` and nothing else of the project.
"""
