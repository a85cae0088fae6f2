"""``python -m outbox`` is the ``outbox`` command."""

from outbox.cli import main

main()
