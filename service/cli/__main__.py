"""``python -m service.cli``: the same as the ``weight-cache`` command."""

from service.cli import main

main()
