"""``python -m cli``: the same as the ``weight-cache`` command."""

from weight_cache_cli import main

main()
