"""Serve the console with uvicorn, logging through the project's handlers."""

from __future__ import annotations

import logging
import signal
import types

import uvicorn

from outbox.events import emit
from outbox.web.app import WebConfig, create_app

log = logging.getLogger("outbox.web")


def uvicorn_config(config: WebConfig, port: int) -> uvicorn.Config:
    """How the console is served (the tests serve it the same way)."""
    return uvicorn.Config(
        create_app(config),
        host=config.host,
        port=port,
        log_config=None,  # the project's handlers (events.configure): text or JSON, redacted
        access_log=False,  # actions are logged as web.* events, with who did them
        server_header=False,
        # uvicorn believes X-Forwarded-For from 127.0.0.1 by default: any local process
        # could then forge the client of an audited action.  Only --trusted-proxy's.
        proxy_headers=bool(config.trusted_proxies),
        forwarded_allow_ips=list(config.trusted_proxies) or None,
    )


def serve(config: WebConfig, port: int) -> None:
    """Run until SIGINT or SIGTERM, finish open requests, return (exit 0, like a relay).

    uvicorn catches the signal, shuts down, restores the handlers it found and raises
    the signal again; the handlers installed here take that second signal quietly.
    """
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _stopped)
    server = uvicorn.Server(uvicorn_config(config, port))
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


def _stopped(signum: int, frame: types.FrameType | None) -> None:
    emit(log, "web.stopped", signal=signal.Signals(signum).name)
