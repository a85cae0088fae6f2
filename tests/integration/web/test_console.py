"""``outbox web`` in a real browser (Debian's chromium through Playwright) over real
PostgreSQL and RabbitMQ: retry, purge, a relay killed with -9 and its batch resolved
by the button, CSRF, authentication and passwords.

The console runs in this process (uvicorn on a thread, on a socket bound here);
relays run as subprocesses.  ``OUTBOX_WEB_SCREENSHOT=docs/images/console.png`` makes
the overview test write the screenshot of docs/how-to/console.md there.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import os
import shutil
import uuid
from collections.abc import Iterator
from typing import Any

import pika
import psycopg
import pytest

from outbox.config import Settings
from tests.fixtures.faults import (
    RelayProcess,
    TcpProxy,
    prepared_left,
    proxied_amqp_url,
    relay_sessions,
    rows_left,
    wait_for,
)
from tests.fixtures.servers import Topology

CHROMIUM = os.environ.get("OUTBOX_TEST_CHROMIUM", "/usr/bin/chromium")
if not shutil.which(CHROMIUM):
    pytest.skip(
        f"chromium is not installed at {CHROMIUM} (apt-get install chromium; .ci/run does)",
        allow_module_level=True,
    )

from playwright.sync_api import Browser, Page, sync_playwright  # noqa: E402

from outbox.db.inbox import render_sql  # noqa: E402
from outbox.web.app import WebConfig  # noqa: E402
from outbox.web.console import ConsoleConfig, InboxTarget  # noqa: E402
from outbox.web.security import Credentials  # noqa: E402
from tests.fixtures.web import Console, http, start_console  # noqa: E402
from tests.integration.ops.test_fleet_ops import fleet_databases  # noqa: E402, F401

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
INBOX = "web_inbox"
PASSWORD = "S3cr3t-Pg-W0rd"  # in the console's DSN; trust auth ignores it


# -- the console, the browser -------------------------------------------------------
@pytest.fixture
def web_config(settings: Settings) -> WebConfig:
    dsn = psycopg.conninfo.make_conninfo(settings.dsn, password=PASSWORD)
    console_settings = dataclasses.replace(settings, dsn=dsn)
    return WebConfig(
        console=ConsoleConfig(
            outboxes=(console_settings,),
            inboxes=(InboxTarget(dsn, INBOX),),
            refresh_seconds=0.5,
        ),
        amqp_url=settings.amqp_url,
        credentials=Credentials(),
    )


@pytest.fixture
def console(web_config: WebConfig) -> Iterator[Console]:
    with psycopg.connect(web_config.console.outboxes[0].dsn, autocommit=True) as conn:
        conn.execute(render_sql(INBOX).replace("BEGIN;", "").replace("COMMIT;", ""))
    running = start_console(web_config)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh browser tab; the test fails if a page logged an error (a script or
    style the Content-Security-Policy blocked, a failed request)."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(15_000)
    tab = context.new_page()
    errors: list[str] = []
    tab.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    yield tab
    context.close()
    expected = ("401", "403", "404", "503")  # the refusals and errors the tests provoke
    assert [e for e in errors if not any(code in e for code in expected)] == []


# -- rows ---------------------------------------------------------------------------
def add_dead_letter(
    dsn: str, exchange: str, *, reason: str = "exchange was missing", key: str | None = None
) -> tuple[int, str]:
    message_id = str(uuid.uuid4())
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "INSERT INTO outbox_dead_letters (id, message_id, exchange, routing_key, payload, "
            "headers, created_at, reason, ordering_key) VALUES "
            "(nextval(pg_get_serial_sequence('outbox', 'id')), %s, %s, 'order.created', "
            "convert_to(%s, 'UTF8'), '{\"tenant\": \"t1\"}', now(), %s, %s) RETURNING id",
            [message_id, exchange, f'{{"order": "{message_id[:8]}"}}', reason, key],
        ).fetchone()
    assert row is not None
    return int(row[0]), message_id


def dead_letter_ids(dsn: str) -> list[int]:
    with psycopg.connect(dsn) as conn:
        return [r[0] for r in conn.execute("SELECT id FROM outbox_dead_letters ORDER BY id")]


def add_parked(dsn: str, *, error: str = "ValueError: no such customer") -> str:
    message_id = f"m-{uuid.uuid4().hex[:10]}"
    with psycopg.connect(dsn) as conn:
        conn.execute(
            f"INSERT INTO {INBOX}_parked (consumer, message_id, queue, exchange, routing_key, "
            "body, headers, properties, error, attempts) VALUES "
            "('billing', %s, 'billing.q', 'orders', 'order.created', 'hello', '{}', '{}', %s, 5)",
            [message_id, error],
        )
    return message_id


def parked_ids(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [r[0] for r in conn.execute(f"SELECT message_id FROM {INBOX}_parked")]


def received(topology: Topology) -> list[str]:
    return [str(props.message_id) for _, props, _ in topology.messages(idle=0.3)]


# -- the tests ----------------------------------------------------------------------
def test_web__retry_on_a_dead_letter_publishes_it_once_and_it_leaves_the_list(
    settings: Settings,
    topology: Topology,
    console: Console,
    page: Page,
    caplog: pytest.LogCaptureFixture,
) -> None:
    row_id, message_id = add_dead_letter(settings.dsn, topology.exchange)
    other_id, _ = add_dead_letter(settings.dsn, topology.exchange, reason="another reason")
    relay = RelayProcess(settings)
    try:
        page.goto(f"{console.url}/dead-letters")
        row = page.locator(f"tr.dead-letter[data-id='{row_id}']")
        assert message_id in row.inner_text()
        row.locator("a.retry").click()
        assert page.locator("#count").inner_text() == "1"  # shown before confirming
        page.locator("#confirm").click()
        assert page.locator("#done").inner_text().startswith("1 dead letter moved back")
        [logged] = [r for r in caplog.records if getattr(r, "event", "").startswith("web.")]
        assert logged.event == "web.dead_letters_retried"  # type: ignore[attr-defined]
        assert logged.fields["who"] == "local"  # type: ignore[attr-defined]
        assert logged.fields["rows"] == 1  # type: ignore[attr-defined]
        assert logged.fields["row_ids"] == [row_id]  # type: ignore[attr-defined]

        wait_for(lambda: rows_left(settings.dsn) == 0, 20, "the relay to publish the row")
        assert received(topology) == [message_id]  # once, with its message id
        page.goto(f"{console.url}/dead-letters")
        assert page.locator(f"tr.dead-letter[data-id='{row_id}']").count() == 0
        assert page.locator(f"tr.dead-letter[data-id='{other_id}']").count() == 1
        assert dead_letter_ids(settings.dsn) == [other_id]
    finally:
        relay.close()


def test_web__retry_of_an_ordering_key_counts_all_its_dead_letters_and_keeps_their_order(
    settings: Settings, topology: Topology, console: Console, page: Page
) -> None:
    first = add_dead_letter(settings.dsn, topology.exchange, key="cust-7")
    second = add_dead_letter(settings.dsn, topology.exchange, key="cust-7", reason="other")
    page.goto(f"{console.url}/dead-letters")
    page.locator("table.keys tr", has_text="cust-7").locator("a", has_text="retry key").click()
    assert page.locator("#count").inner_text() == "2"
    page.locator("#confirm").click()
    assert page.locator("#done").inner_text().startswith("2 dead letters moved back")
    with psycopg.connect(settings.dsn) as conn:
        back = conn.execute("SELECT id, message_id::text FROM outbox ORDER BY id").fetchall()
    assert back == [first, second]  # same row ids: the key's order is kept


def test_web__a_reason_group_bigger_than_a_page_is_retried_a_page_at_a_time(
    settings: Settings, console: Console, page: Page
) -> None:
    with psycopg.connect(settings.dsn) as conn:
        conn.execute(
            "INSERT INTO outbox_dead_letters (id, message_id, exchange, routing_key, payload, "
            "created_at, reason) SELECT nextval(pg_get_serial_sequence('outbox', 'id')), "
            "gen_random_uuid(), 'ex', 'rk', 'p', now(), 'broker said 404' "
            "FROM generate_series(1, 1200)"
        )
    page.goto(f"{console.url}/dead-letters")
    assert "Rows 1 to 1000 of 1200" in page.locator("#listing").inner_text()
    page.locator("table.reasons a", has_text="retry group").click()
    assert page.locator("#count").inner_text() == "1000"
    page.locator("#confirm").click()  # 1000 ids and the token in one form
    assert page.locator("#done").inner_text().startswith("1000 dead letters moved back")
    assert len(dead_letter_ids(settings.dsn)) == 200 and rows_left(settings.dsn) == 1000


def test_web__purging_a_parked_group_removes_every_message_of_it(
    settings: Settings, console: Console, page: Page
) -> None:
    group = [add_parked(settings.dsn, error="KeyError: 'sku'") for _ in range(3)]
    other = add_parked(settings.dsn)
    page.goto(f"{console.url}/parked")
    row = page.locator("#listing table.groups tr", has_text="billing: KeyError: 'sku'")
    row.locator("a", has_text="purge group").click()
    assert page.locator("#count").inner_text() == "3"
    page.locator("#confirm").click()
    assert page.locator("#done").inner_text().startswith("3 parked messages purged")
    assert parked_ids(settings.dsn) == [other]
    assert not set(group) & set(parked_ids(settings.dsn))


def test_web__purging_a_selection_of_dead_letters_takes_exactly_the_ticked_ones(
    settings: Settings, topology: Topology, console: Console, page: Page
) -> None:
    ids = [add_dead_letter(settings.dsn, topology.exchange)[0] for _ in range(3)]
    page.goto(f"{console.url}/dead-letters")
    for row_id in (ids[0], ids[2]):
        page.locator(f"tr.dead-letter[data-id='{row_id}'] input[type=checkbox]").check()
    page.locator("button", has_text="Purge selected").click()
    assert page.locator("#count").inner_text() == "2"
    page.locator("#confirm").click()
    assert page.locator("#done").inner_text().startswith("2 dead letters purged")
    assert dead_letter_ids(settings.dsn) == [ids[1]]


def test_web__the_filter_narrows_the_list_as_you_type(
    settings: Settings, topology: Topology, console: Console, page: Page
) -> None:
    kept, _ = add_dead_letter(settings.dsn, topology.exchange, reason="NOT_FOUND - no exchange")
    hidden, _ = add_dead_letter(settings.dsn, topology.exchange, reason="message too large")
    page.goto(f"{console.url}/dead-letters")
    page.locator("form.filter input[type=search]").fill("no exchange")
    page.locator(f"tr.dead-letter[data-id='{hidden}']").wait_for(state="detached")
    assert page.locator(f"tr.dead-letter[data-id='{kept}']").count() == 1
    assert page.url == f"{console.url}/dead-letters"  # swapped in place by htmx


def test_web__purging_a_parked_message_removes_it(
    settings: Settings, console: Console, page: Page
) -> None:
    doomed = add_parked(settings.dsn)
    kept = add_parked(settings.dsn, error="TimeoutError")
    page.goto(f"{console.url}/parked")
    page.locator(f"tr.parked-message[data-message-id='{doomed}'] a.purge").click()
    assert page.locator("#count").inner_text() == "1"
    page.locator("#confirm").click()
    assert page.locator("#done").inner_text().startswith("1 parked message purged")
    assert parked_ids(settings.dsn) == [kept]
    page.goto(f"{console.url}/parked")
    assert page.locator(f"tr.parked-message[data-message-id='{doomed}']").count() == 0
    assert page.locator(f"tr.parked-message[data-message-id='{kept}']").count() == 1


def test_web__retry_on_a_parked_message_sends_it_back_to_its_queue(
    settings: Settings, topology: Topology, console: Console, page: Page
) -> None:
    message_id = add_parked(settings.dsn)
    with psycopg.connect(settings.dsn) as conn:
        conn.execute(f"UPDATE {INBOX}_parked SET queue = %s", [topology.queue])
    page.goto(f"{console.url}/parked")
    page.locator(f"tr.parked-message[data-message-id='{message_id}'] a.retry").click()
    assert page.locator("#count").inner_text() == "1"
    page.locator("#confirm").click()
    assert page.locator("#done").inner_text().startswith("1 parked message sent back")
    assert parked_ids(settings.dsn) == []
    [(_, props, body)] = topology.messages(idle=0.3)
    assert props.message_id == message_id and body == b"hello"
    assert props.headers["x-outbox-original-exchange"] == "orders"


def test_web__a_parked_message_the_broker_does_not_take_stays_parked_and_is_named(
    settings: Settings, topology: Topology, console: Console, page: Page
) -> None:
    """Its queue was deleted: RabbitMQ returns the copy unroutable.  The page says so,
    with why, and the message stays parked (before, the console counted 0 sent and
    said nothing of it)."""
    message_id = add_parked(settings.dsn)
    with psycopg.connect(settings.dsn) as conn:
        conn.execute(f"UPDATE {INBOX}_parked SET queue = %s", [f"{topology.queue}.gone"])
    page.goto(f"{console.url}/parked")
    page.locator(f"tr.parked-message[data-message-id='{message_id}'] a.retry").click()
    page.locator("#confirm").click()
    assert page.locator("#done").inner_text().startswith("0 parked messages sent back")
    assert page.locator("#not-taken").inner_text().startswith("1 not taken by RabbitMQ")
    why = page.locator("ul.not-taken li").inner_text()
    assert why.startswith(message_id) and "unroutable" in why, why
    assert parked_ids(settings.dsn) == [message_id]


class StallingProxy(TcpProxy):
    """After the armed pattern, forwards nothing either way and cuts nothing: the relay
    waits for confirms that never come, with its batch prepared and itself alive."""

    def _downstream(self, pair: Any) -> None:
        with contextlib.suppress(OSError):
            while data := pair.server.recv(65536):
                if not pair.drop_reply:
                    pair.client.sendall(data)
        pair.cut()


def test_web__overview_shows_a_relay_killed_with_minus_9_going_dead_and_the_button_resolves_its_batch(  # noqa: E501
    settings: Settings, topology: Topology, console: Console, page: Page, tmp_path: Any
) -> None:
    add_dead_letter(settings.dsn, topology.exchange, reason="exchange 'billing' was missing")
    add_parked(settings.dsn)
    params = pika.URLParameters(topology.amqp_url)
    proxy = StallingProxy(params.host, params.port)
    stalled = dataclasses.replace(
        settings, amqp_url=proxied_amqp_url(topology.amqp_url, proxy), publish_timeout=120.0
    )
    relay = RelayProcess(stalled)
    try:
        page.goto(console.url)
        wait_for(lambda: relay_sessions(settings.dsn) > 0, 20, "the relay to connect")
        proxy.arm(b"web-stalled-row", after_server=True)
        with psycopg.connect(settings.dsn) as conn:
            conn.execute(
                "INSERT INTO outbox (exchange, routing_key, payload) VALUES (%s, 'k', %s)",
                [topology.exchange, b"web-stalled-row"],
            )
        [gid] = wait_for(lambda: prepared_left(settings.dsn), 20, "the batch to be prepared")

        # The overview refreshes itself: the relay alive, its batch prepared.
        page.locator("tr.relay.alive").wait_for()
        page.locator(f"tr.batch[data-gid='{gid}'] td.owner.alive").wait_for()
        shot = os.environ.get("OUTBOX_WEB_SCREENSHOT")
        page.screenshot(path=shot or tmp_path / "console.png", full_page=True)

        relay.process.kill()  # kill -9
        assert relay.wait() == -9
        wait_for(lambda: relay_sessions(settings.dsn) == 0, 20, "the relay's sessions to end")
        page.locator("tr.relay.dead").wait_for()
        page.locator(f"tr.batch[data-gid='{gid}'] td.owner.dead").wait_for()
        assert page.locator("tr.relay.alive").count() == 0

        page.goto(f"{console.url}/in-doubt")
        page.locator(f"tr.batch[data-gid='{gid}'] td.owner.dead").wait_for()
        page.locator("#dry-run").click()  # what `outbox resolve --dry-run` decides
        decision = page.locator(f"tr.resolution[data-gid='{gid}']")
        assert decision.locator("td.owner").inner_text() == "dead"
        assert decision.locator("td.action").inner_text() == "rollback"
        assert decision.locator("td.outcome").inner_text() == "planned"
        assert prepared_left(settings.dsn) == [gid]  # the dry run changed nothing

        page.locator("#resolve").click()
        assert "1 rolled back" in page.locator("#done").inner_text()
        assert page.locator(f"tr.resolution[data-gid='{gid}'] td.outcome").inner_text() == (
            "rolled_back"
        )
        assert prepared_left(settings.dsn) == []
        assert rows_left(settings.dsn) == 1  # back in the outbox, to be published again
    finally:
        relay.close()
        proxy.close()


def test_web__a_post_without_the_csrf_token_is_refused(
    settings: Settings, topology: Topology, console: Console, page: Page
) -> None:
    row_id, _ = add_dead_letter(settings.dsn, topology.exchange)
    status, body = http(f"{console.url}/dead-letters/purge", data={"id": str(row_id)})
    assert status == 403 and "CSRF" in body
    # With the browser's cookie but a form that lacks the token (what a forged
    # cross-site form cannot know), and with a wrong one.
    page.goto(f"{console.url}/dead-letters")
    for form in ({"id": str(row_id)}, {"id": str(row_id), "csrf_token": "x.y"}):
        response = page.request.post(f"{console.url}/dead-letters/purge", form=form)
        assert response.status == 403
    response = page.request.post(f"{console.url}/in-doubt/resolve", form={})
    assert response.status == 403
    token = page.context.cookies()[0]["value"]  # right token, posted from another site
    response = page.request.post(
        f"{console.url}/dead-letters/purge",
        form={"id": str(row_id), "csrf_token": token},
        headers={"Origin": "http://evil.example"},
    )
    assert response.status == 403 and "another site" in response.text()
    status, _ = http(f"{console.url}/dead-letters/purge")  # GET: not a way to change state
    assert status == 405
    assert dead_letter_ids(settings.dsn) == [row_id]


@pytest.mark.parametrize("trusted", [False, True], ids=["no-proxy", "trusted-proxy"])
def test_web__the_audited_client_is_the_peer_unless_a_trusted_proxy_forwards_it(
    trusted: bool,
    settings: Settings,
    topology: Topology,
    web_config: WebConfig,
    page: Page,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """X-Forwarded-For is believed only from a --trusted-proxy: uvicorn's default
    (believe 127.0.0.1) let any local process name the client of a purge."""
    with psycopg.connect(web_config.console.outboxes[0].dsn, autocommit=True) as conn:
        conn.execute(render_sql(INBOX).replace("BEGIN;", "").replace("COMMIT;", ""))
    config = dataclasses.replace(web_config, trusted_proxies=("127.0.0.1/32",) if trusted else ())
    running = start_console(config)
    try:
        row_id, _ = add_dead_letter(settings.dsn, topology.exchange)
        page.goto(f"{running.url}/dead-letters")
        token = page.context.cookies()[0]["value"]
        response = page.request.post(
            f"{running.url}/dead-letters/purge",
            form={"id": str(row_id), "csrf_token": token, "expected": "1"},
            headers={"X-Forwarded-For": "203.0.113.66"},
        )
        assert response.status == 200, response.text()[:300]
        [logged] = [
            r for r in caplog.records if getattr(r, "event", "") == "web.dead_letters_purged"
        ]
        client = logged.fields["client"]  # type: ignore[attr-defined]
        assert client == ("203.0.113.66" if trusted else "127.0.0.1")
        assert dead_letter_ids(settings.dsn) == []
    finally:
        running.stop()


def test_web__read_only_shows_no_action_and_refuses_posts(
    settings: Settings, topology: Topology, web_config: WebConfig, page: Page
) -> None:
    row_id, _ = add_dead_letter(settings.dsn, topology.exchange)
    config = dataclasses.replace(
        web_config, console=dataclasses.replace(web_config.console, read_only=True, inboxes=())
    )
    running = start_console(config)
    try:
        page.goto(f"{running.url}/dead-letters")
        assert page.locator(f"tr.dead-letter[data-id='{row_id}']").count() == 1
        assert page.locator("a.retry, a.purge, button").count() == 0
        page.goto(f"{running.url}/dead-letters/confirm?action=purge&id={row_id}")
        assert page.locator("#confirm").count() == 0
        page.goto(f"{running.url}/in-doubt")
        assert page.locator("#resolve").count() == 0
        csrf = page.context.cookies()[0]["value"]
        response = page.request.post(
            f"{running.url}/dead-letters/purge", form={"id": str(row_id), "csrf_token": csrf}
        )
        assert response.status == 403 and "read-only" in response.text()
        assert dead_letter_ids(settings.dsn) == [row_id]
    finally:
        running.stop()


def test_web__an_unauthenticated_request_on_a_non_local_bind_is_refused(
    web_config: WebConfig,
) -> None:
    """(Without credentials such a bind does not start: tests/acceptance/test_web_cli.py.)"""
    config = dataclasses.replace(
        web_config,
        host="0.0.0.0",
        credentials=Credentials(token="t0ken-for-test", user="ops", password="pw-for-test"),
    )
    running = start_console(config)
    try:
        for path in ("/", "/dead-letters", "/static/htmx.min.js"):
            status, _ = http(running.url + path)
            assert status == 401, path
        status, _ = http(running.url + "/", headers={"Authorization": "Bearer wrong"})
        assert status == 401
        status, _ = http(running.url + "/", headers={"Authorization": "Bearer t0ken-for-test"})
        assert status == 200
        creds = base64.b64encode(b"ops:pw-for-test").decode()
        status, body = http(running.url + "/", headers={"Authorization": f"Basic {creds}"})
        assert status == 200 and "ops" in body
    finally:
        running.stop()


def test_web__no_page_shows_the_database_password(
    settings: Settings, topology: Topology, web_config: WebConfig, page: Page
) -> None:
    row_id, _ = add_dead_letter(settings.dsn, topology.exchange)
    broken_inbox = InboxTarget(f"postgresql://app:{PASSWORD}@127.0.0.1:1/nowhere", "missing")
    config = dataclasses.replace(
        web_config,
        console=dataclasses.replace(
            web_config.console, inboxes=(*web_config.console.inboxes, broken_inbox)
        ),
    )
    with psycopg.connect(settings.dsn, autocommit=True) as conn:
        conn.execute(render_sql(INBOX).replace("BEGIN;", "").replace("COMMIT;", ""))
    parked_id = add_parked(settings.dsn)
    with psycopg.connect(settings.dsn) as conn:
        found = conn.execute(
            f"SELECT id FROM {INBOX}_parked WHERE message_id = %s", [parked_id]
        ).fetchone()
    assert found is not None
    parked_row = found[0]
    running = start_console(config)
    seen: dict[str, str] = {}

    def visit(path: str) -> None:
        page.goto(running.url + path)
        seen[path] = page.content()

    try:
        for path in (
            "/",
            "/dead-letters",
            f"/dead-letters/{row_id}",
            f"/dead-letters/confirm?action=retry&id={row_id}",
            "/parked",
            f"/parked/confirm?action=purge&row={parked_row}",
            "/parked?inbox=missing",  # an error page quoting what libpq said
            "/in-doubt",
            "/dead-letters?table=nope",
        ):
            visit(path)
        page.goto(f"{running.url}/parked")
        page.locator("tr.parked-message a").first.click()
        seen["parked message"] = page.content()
    finally:
        running.stop()
    assert PASSWORD in config.console.outboxes[0].dsn  # the console was given it
    assert [path for path, html in seen.items() if PASSWORD in html] == []
    assert 'class="error"' in seen["/parked?inbox=missing"]  # the error was shown


def count_of(dsn: str, sql: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(sql).fetchone()
    assert row is not None
    return int(row[0])


def test_web__the_charts_draw_the_last_hour_and_their_numbers_are_the_databases(
    settings: Settings, web_config: WebConfig, page: Page, tmp_path: Any
) -> None:
    """What a relay and a consumer do, done by hand in the database (each step on a
    connection of its own, closed: the statistics counters are flushed then), while a
    report holds a REPEATABLE READ snapshot: the horizon ages, the deleted rows stay
    dead."""
    config = dataclasses.replace(
        web_config, console=dataclasses.replace(web_config.console, sample_seconds=0.2)
    )
    with psycopg.connect(settings.dsn, autocommit=True) as conn:
        conn.execute(render_sql(INBOX).replace("BEGIN;", "").replace("COMMIT;", ""))
    report = psycopg.connect(settings.dsn)
    report.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    report.execute("SELECT count(*) FROM outbox")  # the snapshot is taken here, and kept
    running = start_console(config)
    try:
        page.goto(running.url)
        figure = page.locator("section.charts figure[data-key='published']").first
        figure.wait_for()  # a first sample: the counters' starting point
        with psycopg.connect(settings.dsn) as conn:
            conn.execute(
                "INSERT INTO outbox (exchange, routing_key, payload) "
                "SELECT 'ex', 'rk', 'p' FROM generate_series(1, 6)"
            )
        with psycopg.connect(settings.dsn) as conn:  # a relay publishes three…
            conn.execute("DELETE FROM outbox WHERE id IN (SELECT id FROM outbox LIMIT 3)")
        with psycopg.connect(settings.dsn) as conn:  # …and dead-letters two
            conn.execute(
                "WITH gone AS (DELETE FROM outbox WHERE id IN (SELECT id FROM outbox LIMIT 2) "
                "RETURNING *) INSERT INTO outbox_dead_letters (id, message_id, exchange, "
                "routing_key, payload, created_at, reason) SELECT id, message_id, exchange, "
                "routing_key, payload, created_at, 'exchange missing' FROM gone"
            )
        with psycopg.connect(settings.dsn) as conn:  # a consumer applies four, parks one
            conn.execute(
                f"INSERT INTO {INBOX} (consumer, message_id) "
                "SELECT 'billing', 'm-' || n FROM generate_series(1, 4) n"
            )
        add_parked(settings.dsn)

        def shown(key: str, attribute: str) -> float:
            found = page.locator(f"section.charts figure[data-key='{key}']").first
            return float(found.get_attribute(attribute) or "nan")

        expected = {"published": 3.0, "dead_lettered": 2.0, "applied": 4.0, "parked": 1.0}
        wait_for(
            lambda: {k: shown(k, "data-total") for k in expected} == expected,
            20,
            f"the charts to show {expected}",
        )
        backlog = count_of(settings.dsn, "SELECT count(*) FROM outbox")
        wait_for(lambda: shown("backlog", "data-latest") == backlog, 10, "the backlog")
        assert backlog == 1
        assert count_of(settings.dsn, "SELECT count(*) FROM outbox_dead_letters") == 2
        assert count_of(settings.dsn, f"SELECT count(*) FROM {INBOX}") == 4
        # Drawn: a bar for each rate this minute, a point for each level.
        chart = page.locator("section.charts figure[data-key='dead_lettered'] rect.bar")
        assert [chart.nth(i).get_attribute("data-value") for i in range(chart.count())] == ["2.0"]
        assert page.locator("figure[data-key='backlog'] circle.point").count() >= 1
        # The horizon: the five deleted rows are dead while the report holds them back.
        dead = "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'outbox'"
        wait_for(
            lambda: shown("dead_rows", "data-latest") == count_of(settings.dsn, dead) >= 5,
            10,
            "the dead rows",
        )
        held = (
            "SELECT extract(epoch FROM now() - xact_start)::float8 FROM pg_stat_activity "
            f"WHERE pid = {report.info.backend_pid}"
        )
        with psycopg.connect(settings.dsn, autocommit=True) as conn:
            before = conn.execute(held).fetchone()
            shown_age = shown("horizon_seconds", "data-latest")
            after = conn.execute(held).fetchone()
        assert before is not None and after is not None
        # Sampled up to a sample interval and a page refresh before it was read.
        assert before[0] - 5.0 <= shown_age <= after[0], (before, shown_age, after)
        assert shown_age > 0
        assert page.locator("figure[data-key='horizon_seconds'] circle.point").count() >= 1
        shot = os.environ.get("OUTBOX_WEB_CHARTS_SCREENSHOT")
        box = page.locator("section.charts").bounding_box()  # htmx replaces it: a page shot
        assert box is not None
        page.screenshot(path=shot or tmp_path / "charts.png", clip=box)
    finally:
        page.goto("about:blank")  # no refresh of the overview after the console stops
        running.stop()
        report.close()


def test_web__many_databases_pick_one_and_retry_its_dead_letter_there(
    settings: Settings, fleet: dict[str, str], page: Page, tmp_path: Any
) -> None:
    """``outbox web --targets``: the overview lists every database; following a
    database's link, its pages' links and forms stay on that database."""
    from outbox.fleet.targets import TargetSource
    from tests.integration.ops.test_fleet_ops import write_targets

    a, b, _ = fleet
    row_id, message_id = add_dead_letter(fleet[b], "ex")
    targets = write_targets(tmp_path / "targets", list(fleet.values()))
    running = start_console(
        WebConfig(
            ConsoleConfig((settings,), refresh_seconds=0.5),
            settings.amqp_url,
            Credentials(),
            targets=TargetSource(file=targets, interval=0.0),
        )
    )
    try:
        page.goto(running.url + "/")
        assert page.locator("tr[data-database]").count() == 3
        page.locator(f"tr[data-database='{b}'] a", has_text=b).click()
        assert page.locator("code.database").inner_text() == b
        page.locator("nav a", has_text="Dead letters").click()
        row = page.locator(f"tr.dead-letter[data-id='{row_id}']")
        assert message_id in row.inner_text()
        row.locator("a.retry").click()
        assert page.locator("#count").inner_text() == "1"
        page.locator("#confirm").click()
        assert page.locator("#done").inner_text().startswith("1 dead letter moved back")
        back = page.locator("a", has_text="Back to the list").get_attribute("href")
        assert back == f"/db/{b}/dead-letters?table=outbox"
        assert dead_letter_ids(fleet[b]) == [] and rows_left(fleet[b]) == 1
        assert rows_left(fleet[a]) == 0
    finally:
        running.stop()
