"""Redaction that cannot break a page or leak: passwords chosen to collide with a
table name, a row id, a date and the CSRF token; parked ids and keys shaped like
credentials.  Each page is used as a browser would (its links followed, its forms
posted back as they are), over real PostgreSQL."""

from __future__ import annotations

import html.parser
import re
import urllib.parse
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from outbox import redaction
from outbox.config import Settings
from outbox.db.inbox import render_sql
from outbox.web.app import WebConfig
from outbox.web.console import ConsoleConfig, InboxTarget
from outbox.web.security import Credentials
from tests.fixtures.web import Console, csrf_headers, http, start_console

INBOX = "redact_inbox"


class Forms(html.parser.HTMLParser):
    """The forms (action and fields) and links of a page, as a browser reads them."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.forms: list[tuple[str, list[tuple[str, str]]]] = []
        self.links: list[str] = []
        self.feed(page)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = {k: v or "" for k, v in attrs}
        if tag == "form":
            self.forms.append((found.get("action", ""), []))
        elif tag == "input" and self.forms and "name" in found:
            if found.get("type") != "checkbox":
                self.forms[-1][1].append((found["name"], found.get("value", "")))
        elif tag == "a" and "href" in found:
            self.links.append(found["href"])

    def checkboxes(self, page: str) -> list[tuple[str, str]]:
        """(name, value) of every checkbox: what ticking them all sends."""
        return [
            (dict(a)["name"] or "", dict(a)["value"] or "")
            for a in _tags(page, "input")
            if dict(a).get("type") == "checkbox"
        ]


def _tags(page: str, name: str) -> list[list[tuple[str, str | None]]]:
    found: list[list[tuple[str, str | None]]] = []

    class Tags(html.parser.HTMLParser):
        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            if tag == name:
                found.append(attrs)

    Tags().feed(page)
    return found


@pytest.fixture
def remembered() -> Iterator[None]:
    """Passwords remembered by a test are forgotten after it (the redactor is global)."""
    saved = redaction._default._secrets
    yield
    redaction._default._secrets = saved


def console_with_password(settings: Settings, password: str) -> Console:
    dsn = psycopg.conninfo.make_conninfo(settings.dsn, password=password)  # trust: ignored
    config = WebConfig(
        ConsoleConfig(
            (Settings(dsn=dsn, table=settings.table),), inboxes=(InboxTarget(dsn, INBOX),)
        ),
        settings.amqp_url,
        Credentials(),
    )
    return start_console(config)


@pytest.fixture(autouse=True)
def inbox(settings: Settings) -> None:
    with psycopg.connect(settings.dsn, autocommit=True) as conn:
        conn.execute(render_sql(INBOX).replace("BEGIN;", "").replace("COMMIT;", ""))


def add_dead_letter(dsn: str, row_id: int, key: str | None = None) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "INSERT INTO outbox_dead_letters (id, message_id, exchange, routing_key, payload, "
            "created_at, failed_at, reason, ordering_key) VALUES (%s, %s, 'ex', 'rk', 'p', "
            "now(), '2026-11-26 10:20:30+00', 'exchange missing', %s)",
            [row_id, uuid.uuid4(), key],
        )


def add_parked(dsn: str, message_id: str) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute(
            f"INSERT INTO {INBOX}_parked (consumer, message_id, queue, exchange, routing_key, "
            "body, headers, properties, error, attempts) VALUES "
            "('billing', %s, 'q', 'ex', 'rk', 'b', '{}', '{}', 'ValueError', 1)",
            [message_id],
        )


def count(dsn: str, table: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
    assert row is not None
    return int(row[0])


def follow_and_confirm(console: Console, link: str, headers: dict[str, str]) -> tuple[int, str]:
    """Open a confirmation page by its link and post its form back as it is."""
    status, page = http(console.url + link, headers={"Cookie": headers["Cookie"]})
    assert status == 200, page[:300]
    [(action, fields)] = [f for f in Forms(page).forms if f[0].startswith(("/dead", "/parked"))]
    return http(console.url + action, data=fields, headers={"Cookie": headers["Cookie"]})


@pytest.mark.parametrize(
    "password",
    ["outbox", "98765"],
    ids=["table name", "row id"],
)
def test_web__a_password_equal_to_a_name_an_id_or_a_date_breaks_no_action(
    password: str, settings: Settings, remembered: None
) -> None:
    add_dead_letter(settings.dsn, 98765)
    add_dead_letter(settings.dsn, 98766)
    console = console_with_password(settings, password)
    try:
        headers = csrf_headers(console)
        status, page = http(f"{console.url}/dead-letters")
        assert status == 200
        [first, _] = [link for link in Forms(page).links if "action=purge&id=" in link]
        status, done = follow_and_confirm(console, first, headers)
        assert status == 200 and re.search("1 dead letters? purged", done), done[:500]
        status, page = http(f"{console.url}/dead-letters/98766")
        [retry] = [link for link in Forms(page).links if "action=retry&id=" in link]
        status, done = follow_and_confirm(console, retry, headers)
        assert status == 200 and re.search("1 dead letters? moved back", done), done[:500]
    finally:
        console.stop()
    assert count(settings.dsn, "outbox_dead_letters") == 0


def test_web__a_hex_password_found_in_the_csrf_token_breaks_no_form(
    settings: Settings, remembered: None
) -> None:
    add_dead_letter(settings.dsn, 5)
    console = console_with_password(settings, "irrelevant-here")
    try:
        headers = csrf_headers(console)
        token = headers["X-CSRF-Token"]
        signature = token.rpartition(".")[2]
        redaction.remember(f"postgresql://app:{signature[4:12]}@db/x")  # 8 hex digits
        status, done = follow_and_confirm(
            console, "/dead-letters/confirm?action=purge&id=5", {"Cookie": headers["Cookie"]}
        )
        assert status == 200 and re.search("1 dead letters? purged", done), done[:300]
    finally:
        console.stop()


def test_web__parked_ids_and_keys_that_look_like_credentials_work_and_never_show(
    settings: Settings, remembered: None
) -> None:
    credential_ids = ["password=hunter2x", "amqp://u:secretpw9@h"]
    for message_id in credential_ids:
        add_parked(settings.dsn, message_id)
    add_dead_letter(settings.dsn, 7, key="password=hunter2x")
    console = console_with_password(settings, "S3cr3t-Pg-W0rd")
    try:
        headers = csrf_headers(console)
        pages = {}
        for path in ("/parked", "/dead-letters", "/parked/1", "/dead-letters/7"):
            status, pages[path] = http(console.url + path)
            assert status == 200, path
        rows = Forms("").checkboxes(pages["/parked"])
        assert len(rows) == 2
        query = urllib.parse.urlencode([("action", "purge"), *rows])
        status, pages["confirm"] = http(f"{console.url}/parked/confirm?{query}")
        status, done = follow_and_confirm(console, f"/parked/confirm?{query}", headers)
        assert status == 200 and re.search("2 parked messages purged", done), done[:300]
        [key_link] = [x for x in Forms(pages["/dead-letters"]).links if "retry&key_of=" in x]
        status, done = follow_and_confirm(console, key_link, headers)
        assert status == 200 and re.search("1 dead letters? moved back", done), done[:300]
    finally:
        console.stop()
    assert count(settings.dsn, f"{INBOX}_parked") == 0
    for path, page in pages.items():
        for secret in ("hunter2x", "secretpw9", "S3cr3t-Pg-W0rd"):
            assert secret not in page and urllib.parse.quote(secret) not in page, (path, secret)
