"""``outbox web``: the operator's console (``outbox-relay[web]``; the app is ``outbox.web``)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import click

from outbox.cli.common import (
    env_option,
    known_errors,
    lock_timeout_option,
    server_options,
    settings_from,
    target_source,
    targets_options,
    tuning_options,
)
from outbox.cli.options import DsnType, FiniteFloatRange
from outbox.errors import MissingExtra
from outbox.events import configure
from outbox.web import security

DEFAULT_PORT = 8310


@click.command()
@server_options
@tuning_options
@lock_timeout_option
@targets_options
@click.option(
    "--also-table",
    "also_tables",
    envvar="OUTBOX_WEB_ALSO_TABLES",
    show_envvar=True,
    multiple=True,
    help="Another outbox table in the same database to show (repeatable; the variable "
    "takes several separated by spaces).",
)
@env_option(
    "--inbox-dsn",
    "OUTBOX_INBOX_DSN",
    default=None,
    type=DsnType(),
    help="The consumer's PostgreSQL, for parked messages [default: --dsn].",
)
@click.option(
    "--inbox-table",
    "inbox_tables",
    envvar="OUTBOX_INBOX_TABLE",
    show_envvar=True,
    multiple=True,
    help="An inbox table whose parked messages to show (repeatable; the variable takes "
    "several separated by spaces) [default: none].",
)
@env_option(
    "--host",
    "OUTBOX_WEB_HOST",
    default="127.0.0.1",
    help=f"Address to listen on. Any but loopback requires {security.TOKEN_ENV}, or "
    f"{security.USER_ENV} and {security.PASSWORD_ENV}, in the environment.",
)
@env_option("--port", "OUTBOX_WEB_PORT", default=DEFAULT_PORT, type=click.IntRange(0, 65535))
@env_option(
    "--read-only",
    "OUTBOX_WEB_READ_ONLY",
    is_flag=True,
    default=False,
    help="Show everything, change nothing (no retry, purge or resolve).",
)
@env_option(
    "--max-prepared-age",
    "OUTBOX_MAX_PREPARED_AGE",
    default=60.0,
    type=FiniteFloatRange(0, 365 * 86400),
    help="A prepared batch older than this (s) is flagged on the overview.",
)
@click.option(
    "--trusted-proxy",
    "trusted_proxies",
    envvar="OUTBOX_WEB_TRUSTED_PROXIES",
    show_envvar=True,
    multiple=True,
    help="Address (or network, e.g. 10.0.0.0/8) of a reverse proxy whose "
    "X-Forwarded-For and X-Forwarded-Proto headers are believed (repeatable; the variable "
    "takes several separated by spaces) [default: none: the headers are ignored and the "
    "audit log names the peer address].",
)
@known_errors
def web(
    also_tables: tuple[str, ...],
    inbox_dsn: str | None,
    inbox_tables: tuple[str, ...],
    host: str,
    port: int,
    read_only: bool,
    max_prepared_age: float,
    trusted_proxies: tuple[str, ...],
    targets: str | None,
    discover: str | None,
    databases: str,
    log_level: str,
    log_format: str,
    **options: Any,
) -> None:
    """Serve the operator's console: backlog, relays, in-doubt batches, dead letters and
    parked messages, with retry, purge and resolve (the same code as the CLI).

    Listens on 127.0.0.1 unless --host says otherwise; any other address requires
    credentials from the environment (OUTBOX_WEB_TOKEN, or OUTBOX_WEB_USER and
    OUTBOX_WEB_PASSWORD) and refuses to start without them.

    With --targets or --discover: an overview of every database, and each database's
    pages under /db/NAME/."""
    try:
        from outbox.web.app import WebConfig
        from outbox.web.console import ConsoleConfig, InboxTarget
        from outbox.web.server import serve
    except ImportError as exc:
        raise MissingExtra(
            f"outbox web needs the console's libraries: "
            f"{(exc.name or 'one of them').partition('.')[0]} is not installed",
            "install the web extra: pip install 'outbox-relay[web]'",
        ) from None
    try:
        credentials = security.Credentials.from_env(os.environ)
        security.check_bind(host, credentials)
        proxies = security.trusted_proxies(trusted_proxies)
    except security.BindRefused as exc:
        raise click.UsageError(str(exc)) from None
    configure(log_level, log_format)
    settings = settings_from(**options)
    more = [dataclasses.replace(settings, table=t) for t in also_tables if t != settings.table]
    outboxes = (settings, *more)
    inbox_dsn = inbox_dsn or settings.dsn
    config = WebConfig(
        console=ConsoleConfig(
            outboxes=outboxes,
            inboxes=tuple(
                InboxTarget(
                    inbox_dsn,
                    t,
                    connect_timeout=settings.connect_timeout,
                    statement_timeout=settings.statement_timeout,
                    lock_timeout=settings.lock_timeout,
                    publish_timeout=settings.publish_timeout,
                )
                for t in dict.fromkeys(inbox_tables)
            ),
            read_only=read_only,
            max_prepared_age=max_prepared_age,
        ),
        amqp_url=settings.amqp_url,
        credentials=credentials,
        host=host,
        trusted_proxies=proxies,
        targets=target_source(targets, discover, databases, settings),
    )
    serve(config, port)
