"""``python -m outbox`` is the ``outbox`` command."""

from outbox.entry import main

main()
