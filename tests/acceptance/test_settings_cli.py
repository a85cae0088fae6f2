"""Issue 9, items 6-10: nonsense settings, malformed URLs, passwords, schema, signals.

Every reproduction of the issue, run as a hostile new user runs it: the real
``outbox`` command in a subprocess.  The promise: one clear line (or one JSON
object with ``--log-format json``) and a documented exit code, never a traceback,
and never a piece of a password.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

import psycopg
import pytest

from outbox.config import Settings
from outbox.db.devcluster import free_port
from tests.acceptance.test_cli import assert_one_clear_error
from tests.acceptance.test_dead_letters_cli import add_dead_letter
from tests.fixtures.faults import prepared_left, rows_left, wait_for
from tests.fixtures.servers import Topology, insert_numbered_rows, run_cli, settings_env

USAGE, UNREACHABLE, SCHEMA_TOO_NEW = 2, 3, 5


def clean_env() -> dict[str, str]:
    """The caller's environment without any OUTBOX_* setting."""
    return {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}


def assert_json_lines(stderr: str) -> list[dict[str, object]]:
    """Every stderr line is one JSON object (what log shippers need)."""
    lines = [json.loads(line) for line in stderr.splitlines() if line.strip()]
    assert lines, "nothing on stderr"
    return lines


# -- item 6: every option is validated: one line, exit 2 -------------------------------------
@pytest.mark.parametrize(
    "option",
    [
        ["--poll-interval", "0"],
        ["--poll-interval", "-1"],
        ["--heartbeat-interval", "0"],
        ["--heartbeat-interval", "-1"],
        ["--resolve-interval", "0"],
        ["--resolve-interval", "nan"],
        ["--publish-timeout", "0"],
        ["--max-message-bytes", "-1"],
        ["--ledger-max-age", "abc"],
        ["--batch-size", "0"],
        ["--batch-size", "1000001"],
        ["--relay-timeout", "inf"],
        ["--backoff-initial", "0"],
        ["--ledger-clock-skew", "-5"],
        ["--ledger-queue", "amq.mine"],
        ["--connect-timeout", "0"],
    ],
    ids=lambda option: " ".join(option),
)
def test_relay__a_nonsense_option_is_one_line_and_exit_2(option: list[str]) -> None:
    result = run_cli("relay", "--drain", *option, env=clean_env())
    assert_one_clear_error(result, USAGE, option[0])


def test_relay__a_nonsense_value_from_the_environment_names_the_variable() -> None:
    env = {**clean_env(), "OUTBOX_POLL_INTERVAL": "0"}
    result = run_cli("relay", "--drain", env=env)
    assert_one_clear_error(result, USAGE, "OUTBOX_POLL_INTERVAL", "0.05")


def test_relay__interval_relations_are_checked_too() -> None:
    result = run_cli(
        "relay", "--heartbeat-interval", "30", "--relay-timeout", "60", env=clean_env()
    )
    assert_one_clear_error(result, USAGE, "relay_timeout must be more than twice")


# -- item 7: malformed connection settings ----------------------------------------------------
@pytest.mark.parametrize(
    ("option", "says"),
    [
        (["--dsn", "host=127.0.0.1 password=x port"], "a word without '='"),
        (["--amqp-url", "ftp://guest:guest@127.0.0.1/"], "'ftp' is not amqp or amqps"),
        (["--amqp-url", "127.0.0.1:5672"], "must start with amqp:// or amqps://"),
        (["--amqp-url", "amqp://u:p@h:abc/v"], "port is not a number"),
        (["--amqp-url", "amqp://guest:guest@127.0.0.1:5672/%2F?heartbeat=abc"], "heartbeat"),
        (["--amqp-url", "http://guest:guest@127.0.0.1:5672/"], "'http' is not amqp"),
        (["--amqp-url", ""], "empty"),
        # A Latin-1 'é' (byte 0xE9) where UTF-8 is expected: it reaches Python as a
        # surrogate (PEP 383), which no driver can encode.
        (["--dsn", "host=127.0.0.1 password=S3cr\udce9tPG"], "bytes that are not UTF-8"),
        (["--amqp-url", "amqp://u:S3cr\udce9tXQ@127.0.0.1/%2F"], "bytes that are not UTF-8"),
        (["--connect-timeout", "0"], "0<x<=3600"),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else "",
)
def test_relay__a_malformed_connection_setting_is_one_line_and_exit_2(
    option: list[str], says: str
) -> None:
    result = run_cli("relay", "--drain", *option, env=clean_env())
    assert_one_clear_error(result, USAGE, says)


def test_relay__broker_errors_show_the_vhost_after_a_slash(settings: Settings) -> None:
    port = free_port()
    env = {**settings_env(settings), "OUTBOX_AMQP_URL": f"amqp://sa1:pw@127.0.0.1:{port}/sa1"}
    result = run_cli("relay", "--drain", env=env)
    assert_one_clear_error(result, UNREACHABLE, f"127.0.0.1:{port}/sa1:")


# -- item 8: passwords never leak ---------------------------------------------------------------
MALFORMED = [
    ("--dsn", "postgresql://u:S3cr%tPG@127.0.0.1:5432/postgres", ("S3cr", "tPG")),
    ("--amqp-url", "amqp://sa1:S3cr/etMQ@127.0.0.1:5672/x", ("S3cr", "etMQ")),
    ("--dsn", "postgresql://u:S3cr@tPG@127.0.0.1:5432/postgres", ("S3cr", "tPG")),
    ("--dsn", "host=127.0.0.1 password=S3cr'tPG port", ("S3cr", "tPG")),
]


@pytest.mark.parametrize("log_format", ["text", "json"])
@pytest.mark.parametrize(("option", "value", "pieces"), MALFORMED, ids=lambda v: str(v)[:30])
def test_cli__a_malformed_setting_never_prints_a_piece_of_its_password(
    option: str, value: str, pieces: tuple[str, ...], log_format: str
) -> None:
    for command in (["relay", "--drain"], ["status"], ["init"], ["dead-letters", "list"]):
        result = run_cli(*command, option, value, "--log-format", log_format, env=clean_env())
        output = result.stdout + result.stderr
        assert result.returncode == USAGE, (command, output)
        assert "Traceback" not in output
        for piece in pieces:
            assert piece not in output, (command, output)
        if log_format == "json":
            [entry] = assert_json_lines(result.stderr)
            assert entry["level"] == "error" and entry["exit_code"] == USAGE


@pytest.mark.parametrize(
    ("password", "written"),
    [("S3cr%tPW", "S3cr%25tPW"), ("S3cr/etPW", "S3cr%2FetPW"), ("S3cr@tPW", "S3cr%40tPW")],
)
def test_cli__a_valid_url_with_a_wrong_password_keeps_it_out_of_every_line(
    settings: Settings, password: str, written: str
) -> None:
    # RabbitMQ refuses the login; PostgreSQL cannot be reached at all.
    env = settings_env(settings)
    env["OUTBOX_AMQP_URL"] = f"amqp://guest:{written}@127.0.0.1:5672/%2F"
    for log_format in ("text", "json"):
        relay = run_cli("relay", "--drain", "--log-format", log_format, env=env)
        assert relay.returncode == UNREACHABLE, relay.stderr
        assert "ACCESS_REFUSED" in relay.stderr
        for secret in (password, written, "S3cr"):
            assert secret not in relay.stdout + relay.stderr
    env["OUTBOX_DSN"] = f"postgresql://u:{written}@127.0.0.1:{free_port()}/x"
    for command in (["status", "--json"], ["init"], ["relay", "--log-format", "json"]):
        result = run_cli(*command, env=env)
        assert result.returncode == UNREACHABLE, result.stderr
        assert "S3cr" not in result.stdout + result.stderr


# -- item 10: JSON error lines ------------------------------------------------------------------
def test_cli__with_log_format_json_an_error_is_one_json_object(settings: Settings) -> None:
    env = settings_env(settings)
    env["OUTBOX_DSN"] = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
    result = run_cli("relay", "--drain", "--log-format", "json", env=env)
    assert result.returncode == UNREACHABLE
    [entry] = assert_json_lines(result.stderr)
    assert entry["event"] == "cli.error" and entry["exit_code"] == UNREACHABLE
    assert "cannot connect to PostgreSQL" in str(entry["error"])
    assert "OUTBOX_DSN" in str(entry["hint"])

    usage = run_cli("status", "--max-prepared-age", "-1", env={**env, "OUTBOX_LOG_FORMAT": "json"})
    [entry] = assert_json_lines(usage.stderr)
    assert usage.returncode == USAGE and "--max-prepared-age" in str(entry["error"])


# -- item 9: a schema newer than the code -------------------------------------------------------
def _from_the_future(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute("INSERT INTO outbox_schema_version (version, name) VALUES (99, 'future')")


def test_schema_newer_than_the_code__init_relay_and_status_refuse_with_exit_5(
    settings: Settings,
) -> None:
    _from_the_future(settings.dsn)
    env = settings_env(settings)
    for command in (["init"], ["relay", "--drain"], ["status"], ["resolve"]):
        result = run_cli(*command, env=env)
        assert_one_clear_error(result, SCHEMA_TOO_NEW, "version 99", "newer than this")
        assert "migrated from" not in result.stdout
    with psycopg.connect(settings.dsn) as conn:
        assert conn.execute("SELECT max(version) FROM outbox_schema_version").fetchone() == (99,)


# -- item 10: SIGHUP, dead letters, demo --------------------------------------------------------
def test_relay__sighup_finishes_the_batches_in_flight_and_exits_0(
    settings: Settings, topology: Topology
) -> None:
    total = 20_000
    insert_numbered_rows(settings.dsn, topology.exchange, total)
    script = os.path.join(os.path.dirname(sys.executable), "outbox")
    proc = subprocess.Popen(
        [script, "relay", "--batch-size", "50"],
        env=settings_env(settings),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: rows_left(settings.dsn) < total, 30, "the relay to start publishing")
        proc.send_signal(signal.SIGHUP)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert prepared_left(settings.dsn) == []
    published = len(topology.messages())
    assert published + rows_left(settings.dsn) == total  # every row in exactly one place
    with psycopg.connect(settings.dsn) as conn:
        assert conn.execute("SELECT count(*) FROM outbox_relays").fetchone() == (0,)


@pytest.mark.parametrize(
    "args",
    [
        ["list", "--limit", "-1"],
        ["list", "--limit", "0"],
        ["purge", "--older-than", "99999999999999999999w"],
        ["purge", "--older-than", "soon"],
    ],
    ids=" ".join,
)
def test_dead_letters__nonsense_values_are_one_line_and_exit_2(
    settings: Settings, args: list[str]
) -> None:
    result = run_cli("dead-letters", *args, env=settings_env(settings))
    assert_one_clear_error(result, USAGE, args[1])


def test_dead_letters_purge__an_unknown_id_exits_1_like_retry(settings: Settings) -> None:
    known = add_dead_letter(settings.dsn)
    unknown = str(uuid.uuid4())
    env = settings_env(settings)
    purge = run_cli("dead-letters", "purge", known, unknown, env=env)
    assert purge.returncode == 1, purge.stderr
    assert "1 dead letters purged" in purge.stdout
    assert unknown in purge.stderr and known not in purge.stderr
    retry = run_cli("dead-letters", "retry", unknown, env=env)
    assert retry.returncode == 1


def test_demo__a_wrong_broker_password_is_one_line_and_exit_3(dsn: str, amqp_url: str) -> None:
    bad = amqp_url.replace("guest:guest@", "guest:Wr0ngPw@")
    assert bad != amqp_url
    result = run_cli("demo", "--dsn", dsn, "--amqp-url", bad, "--rows", "10")
    assert_one_clear_error(result, UNREACHABLE, "ACCESS_REFUSED")
    assert "Wr0ngPw" not in result.stdout + result.stderr


# Issue 18, item 4: the consumer's commands parse their options with the relay's
# checks (one set of decorators), never a silent default broker or a traceback.
CONSUMER_NONSENSE = [
    (["--amqp-url", ""], "it is empty"),
    (["--amqp-url", ";amqp://guest:guest@127.0.0.1/adv"], "an empty URL in the list"),
    (["--amqp-url", "http://127.0.0.1/"], "'http' is not amqp or amqps"),
    (["--prefetch", "70000"], "--prefetch"),
    (["--queue", "q" * 300], "longer than 255 bytes"),
    (["--consumer-name", ""], "consumer name is empty"),
    (["--connect-timeout", "nan"], "not a finite number"),
    (["--retry-delay", "nan"], "not a finite number"),
    (["--retry-delay-max", "inf"], "--retry-delay-max"),
    (["--inbox-retention", "soon"], "--inbox-retention"),
    (["--backoff-max", "nan"], "--backoff-max"),
    (["--dsn", "host=db password=sekrit port=x:y"], "--dsn"),
    # Issue 31, item 8: contradictory or useless values, once accepted.
    (["--retry-delay", "10", "--retry-delay-max", "1"], "--retry-delay-max"),
    (["--retry-delay-max", "86400"], "--retry-delay-max"),
    (["--backoff-initial", "100", "--backoff-max", "1"], "--backoff-max"),
    (["--inbox-retention", "0.0001s"], "retention must be at least"),
    (["--delivery-limit", "-1"], "--delivery-limit"),
]


@pytest.mark.parametrize(
    ("args", "says"), CONSUMER_NONSENSE, ids=[" ".join(a)[:40] for a, _ in CONSUMER_NONSENSE]
)
def test_consume__a_nonsense_option_is_one_line_and_exit_2(args: list[str], says: str) -> None:
    result = run_cli("consume", "no_such_module:handler", "--queue", "q", *args)
    assert_one_clear_error(result, USAGE, says)
    assert "sekrit" not in result.stderr + result.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["list", "--amqp-url", ""],
        ["retry", "--all", "--amqp-url", ";amqp://guest:guest@127.0.0.1/"],
        ["purge", "--older-than", "soon"],
        ["purge", "--older-than", "99999999999999999999w"],
        ["list", "--connect-timeout", "nan"],
        # Issue 31, item 8: once exit 1 with a privilege hint, and "no parked messages".
        ["list", "--limit", "-1"],
        ["list", "--limit", "0"],
    ],
    ids=" ".join,
)
def test_parked__nonsense_values_are_one_line_and_exit_2(args: list[str]) -> None:
    result = run_cli("parked", *args)
    assert_one_clear_error(result, USAGE, [a for a in args if a.startswith("--")][-1])
