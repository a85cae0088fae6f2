"""The example consumer's handler (``deploy/Dockerfile``, target consumer-example).

``outbox consume`` calls ``record(conn, message)`` inside the transaction that
records the message's id in the inbox: whatever it writes on ``conn`` commits with
that id, exactly once.  This one only logs what arrived; replace the module with
your own (``MODULE:FUNCTION`` in ``OUTBOX_HANDLER``) and build the image the same way.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("example_handler")


def record(conn: Any, message: Any) -> None:
    log.info(
        "example.received message_id=%s routing_key=%s bytes=%d",
        message.message_id,
        message.routing_key,
        len(message.body),
    )
