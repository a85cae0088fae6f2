"""The console's lists over the whole table, with paging; every input it does not
understand is a 400 with a one-line reason, never a 500; the overview's words."""

from __future__ import annotations

import re
from collections.abc import Iterator

import psycopg
import pytest

from outbox.config import Settings
from tests.fixtures.web import Console, http, inbox_console

INBOX = "lists_inbox"


@pytest.fixture
def console(settings: Settings) -> Iterator[Console]:
    with inbox_console(settings, INBOX) as running:
        yield running


def add_dead_letters(dsn: str, count: int) -> None:
    """``count`` dead letters, oldest first, with ordering keys key-0, key-1, …"""
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "INSERT INTO outbox_dead_letters (id, message_id, exchange, routing_key, payload, "
            "created_at, failed_at, reason, ordering_key) "
            "SELECT nextval(pg_get_serial_sequence('outbox', 'id')), gen_random_uuid(), 'ex', "
            "'rk', 'p', now(), now() - make_interval(secs => %s - n), 'exchange missing', "
            "'key-' || n FROM generate_series(0, %s - 1) AS n",
            [count, count],
        )


def listed(page: str) -> list[str]:
    return re.findall(r'<tr class="dead-letter" data-id="(\d+)"', page)


def test_web__the_filter_searches_the_whole_table_not_the_oldest_thousand(
    settings: Settings, console: Console
) -> None:
    add_dead_letters(settings.dsn, 2500)
    add_dead_letters(settings.dsn, 1)  # one more dead letter of key-0…
    with psycopg.connect(settings.dsn) as conn:  # …made key-2499's, the newest of all
        conn.execute(
            "UPDATE outbox_dead_letters SET ordering_key = 'key-2499' "
            "WHERE id = (SELECT max(id) FROM outbox_dead_letters)"
        )
    status, page = http(f"{console.url}/dead-letters?q=key-2499")
    assert status == 200 and len(listed(page)) == 2, page[-800:]
    status, page = http(f"{console.url}/dead-letters?q=KEY-249")  # key-249, key-2490…2499
    assert len(listed(page)) == 12


def test_web__a_long_list_is_paged(settings: Settings, console: Console) -> None:
    add_dead_letters(settings.dsn, 2500)
    status, first = http(f"{console.url}/dead-letters")
    assert status == 200 and len(listed(first)) == 1000
    assert 'Rows 1 to 1000 of <span class="total">2500</span>' in first
    [following] = re.findall(r'<a class="next" href="([^"]+)"', first)
    status, second = http(console.url + following.replace("&amp;", "&"))
    assert status == 200 and len(listed(second)) == 1000
    assert not set(listed(first)) & set(listed(second))
    status, last = http(f"{console.url}/dead-letters?offset=2000")
    assert len(listed(last)) == 500 and 'class="next"' not in last


@pytest.mark.parametrize(
    "path",
    [
        "/dead-letters/" + "9" * 5000,
        "/dead-letters/" + "9" * 20,
        "/parked/" + "1" * 5000,
        "/dead-letters/" + "9" * 5000 + "/payload",
        "/parked/confirm?action=retry&id=%00",
        "/parked/confirm?action=retry&row=%00",
        "/parked/confirm?action=purge&group_of=x",
        "/dead-letters/confirm?action=retry&id=%00",
        "/dead-letters/confirm?action=retry&id=" + "9" * 5000,
        "/dead-letters/confirm?action=retry&key_of=-1",
        "/dead-letters/confirm?action=retry&reason_of=1&reason_of=2",
        "/dead-letters/confirm?action=retry&key=k",
        "/dead-letters?q=%00",
        "/dead-letters?q=" + "x" * 600,
        "/dead-letters?offset=-5",
        "/parked?offset=" + "9" * 5000,
    ],
)
def test_web__inputs_that_name_no_row_are_a_400_with_a_one_line_reason(
    path: str, console: Console
) -> None:
    status, page = http(console.url + path)
    assert status == 400, page[:300]
    [reason] = re.findall(r'<p class="error" id="error">([^<]*)</p>', page)
    assert reason and "\n" not in reason and len(reason) < 200


def test_web__the_overview_speaks_of_1_row_and_links_its_own_pages(
    settings: Settings, console: Console
) -> None:
    add_dead_letters(settings.dsn, 1)
    with psycopg.connect(settings.dsn) as conn:
        conn.execute("INSERT INTO outbox (exchange, routing_key, payload) VALUES ('e', 'k', 'p')")
    status, page = http(console.url + "/")
    assert status == 200
    assert re.search(r'id="backlog-outbox">1 row<', page)
    assert "1 rows" not in page and "0 parked messages" in page
    assert "outbox dead-letters" not in page  # the console has its own page for that
    assert 'href="/dead-letters?table=outbox">Dead letters</a>' in page


def test_web__the_overview_shows_the_scheduled_rows_and_the_next_due(
    settings: Settings, console: Console
) -> None:
    with psycopg.connect(settings.dsn) as conn:
        conn.execute(
            "INSERT INTO outbox (exchange, routing_key, payload, deliver_at)"
            " VALUES ('e', 'k', 'p', now() + interval '2 hours')"
        )
    status, page = http(console.url + "/")
    assert status == 200
    assert re.search(r'id="scheduled-outbox">1 row, next due in (2\.0h|1\.9h)<', page), page
