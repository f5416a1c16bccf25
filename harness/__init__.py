"""What the tests and the benchmarks both run the product with: real daemons started and stopped
(:mod:`.daemon_process`), the one place that polls (:mod:`.waiting`), code run in a fresh Python
process (:mod:`.python_child`), checkpoints rewritten (:mod:`.checkpoint_tools`), the hostile
neighbour's tools (:mod:`.hostile`) and the processing in plain torch (:mod:`.plain_processing`).

It imports the product and nothing of ``tests/`` or ``bench/``, which both import it
(``tests/test_architecture.py`` holds the rule).
"""
