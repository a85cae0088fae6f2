"""The console's pure helpers: groups, filters, body views, selections."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from outbox.web import console
from outbox.web.app import where_amqp, where_dsn

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)


def at(minutes: int) -> datetime.datetime:
    return T0 + datetime.timedelta(minutes=minutes)


def test_body_views__text_json_and_hex() -> None:
    views = console.body_views(b'{"b": 1, "a": [2]}')
    assert views.size == 18
    assert views.text == '{"b": 1, "a": [2]}'
    assert views.json == '{\n  "a": [\n    2\n  ],\n  "b": 1\n}'
    assert views.hex.startswith("00000000  7b 22 62 22")
    binary = console.body_views(bytes(range(20)))
    assert binary.text is None and binary.json is None
    assert binary.hex.splitlines()[1].startswith("00000010  10 11 12 13")


def test_body_views__a_long_body_shows_its_beginning_and_says_so() -> None:
    # A dead letter too large to publish holds up to 1 GB: shown whole, its hex view
    # alone was 4.3 times that (a 21 MB body made a 169 MB page and 700 MB of RSS).
    most = console.BODY_SHOWN
    views = console.body_views(b"[" + b"1," * most + b"1]")
    assert (views.size, views.shown) == (2 * most + 3, most)
    assert views.json is None and views.text == "[" + "1," * (most // 2 - 1) + "1"
    assert len(views.hex.splitlines()) == most // 16
    # Already cut by the database: its size comes separately, a character cut in two
    # at the end is left out rather than turning the text view into hex only.
    part = ("é" * most).encode()[: most - 1]
    views = console.body_views(part, size=10 * most)
    assert views.size == 10 * most and views.text == "é" * (most // 2 - 1)


def test_dead_letter_selection__row_ids_and_keys_deduplicated_message_ids_refused() -> None:
    selection = console.DeadLetterSelection.parse(["3", "1", "3", " "], ["k2", "k1", "k2"])
    assert selection == console.DeadLetterSelection((1, 3), ("k1", "k2"))
    assert not console.DeadLetterSelection.parse([], [])
    with pytest.raises(ValueError, match="row id"):
        console.DeadLetterSelection.parse(["0b7a1b5e-8a4f-4b57-9d0e-2f1d0c6e9a10"], [])
    with pytest.raises(ValueError):
        console.DeadLetterSelection.parse(["drop table"], [])


def test_where__connection_settings_are_shown_without_their_password() -> None:
    assert (
        where_dsn("postgresql://app:S3cr%40t@db.internal:5433/orders")
        == "app@db.internal:5433/orders"
    )
    assert where_dsn("host=db dbname=app password=S3cret") == "db/app"
    amqp = where_amqp("amqp://u:S3cret@mq1:5672/%2F;amqp://u:S3cret@mq2:5672/%2F")
    assert "S3cret" not in amqp and "mq1:5672" in amqp and "mq2:5672" in amqp


def test_shown__a_remembered_password_is_masked_before_html_escaping() -> None:
    from outbox import redaction
    from outbox.config import Settings
    from outbox.web.security import Credentials
    from outbox.web.site import Pages, WebConfig

    secret = "Pw<&\"'>x9"
    redaction.remember(f"host=db password='{secret}'")
    pages = Pages(
        WebConfig(console.ConsoleConfig((Settings(),)), "amqp://localhost", Credentials())
    )
    template = pages.env.from_string("<pre>{{ body }}</pre><p>{{ reason }}</p>")
    html = template.render(
        body=console.shown('{"password": "hunter2-x"}'), reason=console.shown(f"refused: {secret}")
    )
    assert secret not in html and "Pw&lt;&amp;" not in html
    assert "hunter2-x" not in html
    assert "***" in html


def testloggable__a_path_chosen_by_a_client_cannot_forge_a_log_line() -> None:
    from outbox.web.site import loggable

    assert loggable("/x\nweb.resolved who=admin") == "/x\\nweb.resolved\\x20who=admin"
    assert len(loggable("/" + "a" * 500)) == 200


def test_body_views__a_password_in_a_body_is_masked_in_the_hex_view_too() -> None:
    # The text and JSON views were masked (on the page), but the hex view spelled
    # the database password out byte by byte.
    from outbox import redaction

    redaction.remember("postgresql://app:Hx-s3cret-pw@db/orders")
    for body in (
        b'{"dsn": "postgresql://app:Hx-s3cret-pw@db/orders"}',  # text
        b"\x00\xff password Hx-s3cret-pw",  # binary
    ):
        views = console.body_views(body)
        shown = bytes.fromhex("".join(line[10:57] for line in views.hex.splitlines()))
        assert b"Hx-s3cret-pw" not in shown and b"***" in shown, views.hex
        assert "Hx-s3cret-pw" not in views.hex


def test_charts__levels_keep_their_last_sample_counters_add_their_increases() -> None:
    from outbox.web import charts

    now = 60 * 1000 + 30  # 30 s into a minute
    samples = [
        charts.Sample(now - 125, {"backlog": 7, "dead_lettered": 10}),  # two minutes ago
        charts.Sample(now - 70, {"backlog": 5, "dead_lettered": 13}),  # a minute ago
        charts.Sample(now - 20, {"backlog": 4, "dead_lettered": 14}),
        charts.Sample(now - 10, {"backlog": 9, "dead_lettered": 2}),  # counter reset
        charts.Sample(now, {"backlog": 3, "dead_lettered": 6}),
    ]
    backlog = charts.per_minute(samples, "backlog", "level", now, minutes=4)
    assert backlog == (None, 7.0, 5.0, 3.0)
    dead = charts.per_minute(samples, "dead_lettered", "rate", now, minutes=4)
    assert dead == (None, 0.0, 3.0, 1.0 + 0.0 + 4.0)
    [chart] = charts.charts(samples, [("dead_lettered", "Dead", "per minute", "rate")], now)
    assert chart.total == 8.0 and chart.latest == 5.0 and chart.scale == 5.0
    assert [bar.minute for bar in chart.bars][-2:] == [1, 0]


def test_sampler__charts_the_outboxs_dead_rows_and_the_horizons_age_from_its_one_sample(
    monkeypatch: Any,
) -> None:
    """Issue 30: the charts show the MVCC horizon and the dead rows, from the same
    one-statement sample as the backlog (levels: the last sample of each minute)."""
    from outbox.config import Settings
    from outbox.web import sampler as sampler_module
    from outbox.web.security import Credentials
    from outbox.web.site import Pages, WebConfig

    rows = iter(
        [
            {"backlog": 2, "oldest_seconds": 1.0, "deleted": 10, "dead_lettered": 1,
             "dead_rows": 40, "horizon_seconds": 12.5},
            {"backlog": 1, "oldest_seconds": 0.5, "deleted": 13, "dead_lettered": 1,
             "dead_rows": 43, "horizon_seconds": 75.0},
        ]
    )  # fmt: skip

    class Store:
        def chart_sample(self) -> dict[str, float]:
            return next(rows)

        def close(self) -> None:
            pass

    monkeypatch.setattr(sampler_module.status, "open_reader", lambda settings, **_: Store())
    now = [60 * 1000 + 10.0]
    config = console.ConsoleConfig((Settings(),))
    sampler = sampler_module.Sampler(config, clock=lambda: now[0])
    sampler.sample()
    now[0] += 30
    sampler.sample()
    [section] = sampler.charts()
    found = {chart.key: chart for chart in section["charts"]}
    assert found["dead_rows"].latest == 43.0 and found["dead_rows"].kind == "level"
    assert found["horizon_seconds"].latest == 75.0 and found["horizon_seconds"].unit == "s"
    assert found["published"].total == 3.0  # the other series are unchanged

    pages = Pages(WebConfig(config, "amqp://localhost", Credentials()))
    html = pages.env.get_template("_charts.html").render(charts=[section])
    assert 'data-key="dead_rows" data-latest="43.0"' in html
    assert 'data-key="horizon_seconds" data-latest="75.0"' in html
    assert 'Dead rows: <strong class="figure">43</strong> rows now' in " ".join(html.split())
    assert 'MVCC horizon age: <strong class="figure">1.2m</strong>' in " ".join(html.split())


def test_in_console__what_status_finds_links_the_console_page_not_a_command() -> None:
    """The overview said "see `outbox dead-letters list`" next to its own Dead
    letters page."""
    from outbox.ops import status

    seen = status.Observation(
        table="outbox",
        schema_version=5,
        backlog_rows=1,
        oldest_row_age_seconds=900.0,
        prepared_batches=[{"gid": "obx:outbox:" + "a" * 32 + ":1", "age_seconds": 600.0}],
        foreign_prepared_transactions=[],
        relays=[],
        dead_letters=3,
        dead_letter_ordering_keys=2,
        replication_warning=None,
    )
    problems = status.judge(seen, max_prepared_age=60, max_backlog_age=300)
    shown = [console.in_console(p, "outbox") for p in problems]
    assert len(shown) == 4
    assert not [s for s in shown if "`outbox" in s["text"]]
    assert [s["page"] for s in shown] == ["In-doubt batches", "Dead letters", "Dead letters", ""]
    assert shown[1] == {
        "text": "3 dead letters",
        "link": "/dead-letters?table=outbox",
        "page": "Dead letters",
    }
