"""Serve the console with uvicorn, logging through the project's handlers."""

from __future__ import annotations

import logging

import uvicorn

from outbox.events import emit
from outbox.web.app import WebConfig, create_app

log = logging.getLogger("outbox.web")


def serve(config: WebConfig, port: int) -> None:
    """Run until SIGINT or SIGTERM (uvicorn's handlers), then finish open requests."""
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(config),
            host=config.host,
            port=port,
            log_config=None,  # the project's handlers (events.configure): text or JSON, redacted
            access_log=False,  # actions are logged as web.* events, with who did them
            server_header=False,
        )
    )
    cfg = config.console
    emit(
        log,
        "web.started",
        host=config.host,
        port=port,
        read_only=cfg.read_only,
        auth=bool(config.credentials),
        tables=[s.table for s in cfg.outboxes],
        inbox_tables=[t.table for t in cfg.inboxes],
    )
    server.run()
