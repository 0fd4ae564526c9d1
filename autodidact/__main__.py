"""``python -m autodidact`` is the ``autodidact`` command."""

from autodidact.cli import main

main()
