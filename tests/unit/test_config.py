"""``Settings`` refuses what cannot work, so the Python API is as safe as the CLI."""

from __future__ import annotations

import dataclasses
import math

import pytest

from outbox.cli.options import limited
from outbox.config import LIMITS, Settings


def out_of_range(field: str) -> list[float]:
    limit = LIMITS[field]
    if isinstance(getattr(Settings(), field), int):
        return [int(limit.low) - 1, int(limit.high) + 1, -1]
    below = limit.low if limit.above else limit.low - 0.001
    return [below, limit.high * 1.001, -1.0, math.nan, math.inf]


@pytest.mark.parametrize("field", sorted(LIMITS))
def test_settings__refuses_every_number_outside_its_range(field: str) -> None:
    for value in out_of_range(field):
        with pytest.raises(ValueError, match=field):
            Settings(**{field: value})


@pytest.mark.parametrize("field", sorted(LIMITS))
def test_settings__the_cli_option_refuses_exactly_what_settings_refuses(field: str) -> None:
    import click

    option_type = limited(field)
    for value in out_of_range(field):
        with pytest.raises(click.BadParameter):
            option_type.convert(str(value), None, None)
    limit = LIMITS[field]
    edge = limit.high  # the top of every range is allowed, in both places
    assert option_type.convert(str(edge), None, None) == edge


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"poll_interval": 0}, "poll_interval must be at least 0.05"),
        ({"heartbeat_interval": -1}, "heartbeat_interval must be at least 0.05"),
        ({"resolve_interval": 0}, "resolve_interval must be at least 0.05"),
        ({"publish_timeout": 0}, "publish_timeout must be above 0"),
        ({"max_message_bytes": -1}, "max_message_bytes must be at least 1"),
        ({"connect_timeout": 0}, "connect_timeout must be above 0"),
        ({"ledger_max_age": "abc"}, "ledger_max_age must be a whole number and a unit"),
        ({"ledger_max_age": "7d"}, "ledger_max_age"),  # RabbitMQ: D is days, d is nothing
        ({"ledger_max_age": "0D"}, "ledger_max_age"),
        ({"ledger_queue": ""}, "ledger_queue is empty"),
        ({"ledger_queue": "amq.ledger"}, "reserves"),
        ({"ledger_queue": "q" * 256}, "longer than 255 bytes"),
        ({"backoff_initial": 5.0, "backoff_max": 1.0}, "backoff_max must be at least"),
        ({"dsn": "host=127.0.0.1 password=x port"}, "dsn: libpq cannot read it"),
        ({"amqp_url": ""}, "amqp_url: it is empty"),
        ({"amqp_url": "http://guest:guest@localhost/"}, "amqp_url: the scheme 'http'"),
        ({"amqp_ca_file": "/etc/ssl/ca.pem"}, "amqp_url is not amqps"),
        (
            {
                "amqp_url": "amqps://u:p@h/v?ssl_options=%7B%7D",
                "amqp_ca_file": "/etc/ssl/ca.pem",
            },
            "give the CA in one place",
        ),
    ],
)
def test_settings__refuses_nonsense_from_the_issue(change: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        Settings(**change)  # type: ignore[arg-type]


def test_settings__accepts_the_documented_forms() -> None:
    settings = Settings(
        amqp_url="amqps://u:p%40ss@mq1/prod;amqps://u:p%40ss@mq2/prod",
        amqp_ca_file="/etc/ssl/ca.pem",
        dsn="postgresql://u:p%40ss@db/app?sslmode=verify-full&sslrootcert=/etc/ssl/ca.pem",
        ledger_max_age="12h",
        poll_interval=0.05,
    )
    assert dataclasses.replace(settings, ledger_max_age="1Y").ledger_max_age == "1Y"


@pytest.mark.parametrize(
    "seconds, text", [(604800.0, "7d"), (5 * 3600, "5h"), (60.0, "1m"), (90, "90s"), (0.5, "0.5s")]
)
def test_age_text__says_a_settings_default_as_the_option_reads_it(
    seconds: float, text: str
) -> None:
    """``outbox consume --inbox-retention``'s default is read from ``ConsumerSettings``
    (seconds) and shown as an age the option takes back unchanged."""
    from outbox.cli.options import age_text
    from outbox.ops.deadletters import parse_age

    assert age_text(seconds) == text
    assert parse_age(text) == seconds
