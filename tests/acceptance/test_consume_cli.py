"""``outbox consume`` and ``outbox parked`` as users run them (subprocesses)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pika
import psycopg
import pytest

from outbox.db.devcluster import free_port
from tests.acceptance.test_cli import assert_one_clear_error
from tests.acceptance.test_operations_cli import http_get
from tests.fixtures.faults import wait_for
from tests.fixtures.servers import Topology, run_cli
from tests.integration.inbox.test_inbox import (
    create_effects_table,
    effects,
    new_ids,
    publish,
    ready_messages,
)

# The handler file of docs/how-to/consuming.md, as a user writes it.
HANDLER_FILE = """
def on_order(conn, message):
    order = message.json()
    conn.execute(
        "INSERT INTO effects (message_id, body) VALUES (%s, %s)",
        [message.message_id, str(order["id"]).encode()],
    )


def always_fails(conn, message):
    raise ValueError("the handler is broken")
"""


@pytest.fixture
def consumer_dsn(empty_dsn: str) -> str:
    return create_effects_table(empty_dsn)


def consume_env(dsn: str, topology: Topology, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OUTBOX_DSN=dsn,
        OUTBOX_AMQP_URL=topology.amqp_url,
        OUTBOX_QUEUE=topology.queue,
        OUTBOX_RETRY_DELAY="0.01",
        OUTBOX_CONNECT_TIMEOUT="3",
        **extra,
    )
    return env


def outbox_script() -> str:
    return os.path.join(os.path.dirname(sys.executable), "outbox")


def test_consume_cli__the_readme_handler_file_and_one_command(
    consumer_dsn: str, topology: Topology, tmp_path: Path
) -> None:
    (tmp_path / "handlers.py").write_text(HANDLER_FILE)
    port = free_port()
    queue = f"{topology.queue}.readme"
    env = dict(os.environ, OUTBOX_DSN=consumer_dsn, OUTBOX_AMQP_URL=topology.amqp_url)
    proc = subprocess.Popen(
        [
            outbox_script(),
            "consume",
            "handlers:on_order",
            "--queue",
            queue,
            "--bind",
            f"{topology.exchange}:order.*",
            "--metrics-port",
            str(port),
            "--log-format",
            "json",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: http_get(port, "/readyz")[0] == 200, 30, "the consumer to be ready")
        ch = topology.channel()
        for n, message_id in enumerate(ids := new_ids(3)):
            ch.basic_publish(
                topology.exchange,
                "order.created",
                json.dumps({"id": n}).encode(),
                pika.BasicProperties(message_id=message_id),
            )
        ch.connection.close()
        wait_for(lambda: "outbox_consumer_handled_total 3.0" in http_get(port, "/metrics")[1])
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
        ch = topology.channel()
        ch.queue_delete(queue)
        ch.connection.close()
    assert proc.returncode == 0, stderr
    events = [json.loads(line) for line in stderr.splitlines()]  # every line is JSON
    assert {"consumer.queue_declared", "consumer.started", "consumer.summary"} <= {
        e["event"] for e in events
    }
    assert effects(consumer_dsn) == [(m, str(n).encode()) for n, m in enumerate(ids)]


def test_consume_cli__print_sql_creates_tables_the_consumer_then_uses(
    consumer_dsn: str, topology: Topology, tmp_path: Path
) -> None:
    result = run_cli("consume", "--print-sql", "--inbox-table", "billing_inbox")
    assert result.returncode == 0, result.stderr
    with psycopg.connect(consumer_dsn, autocommit=True) as conn:
        conn.execute(result.stdout.encode())
        tables = {
            r[0]
            for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE tablename LIKE 'billing_inbox%%'"
            ).fetchall()
        }
    assert tables == {
        "billing_inbox",
        "billing_inbox_attempts",
        "billing_inbox_parked",
        "billing_inbox_custody",
    }
    (tmp_path / "handlers.py").write_text(HANDLER_FILE)
    [message_id] = new_ids(1)
    publish(topology, [(message_id, b'{"id": 7}')])
    env = consume_env(consumer_dsn, topology, OUTBOX_INBOX_TABLE="billing_inbox")
    proc = subprocess.Popen(
        [outbox_script(), "consume", "handlers:on_order"],
        cwd=tmp_path,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: effects(consumer_dsn) == [(message_id, b"7")], 30)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr


def test_consume_cli__errors_are_one_line_with_documented_exit_codes(
    consumer_dsn: str, topology: Topology, tmp_path: Path
) -> None:
    (tmp_path / "handlers.py").write_text(HANDLER_FILE)
    env = consume_env(consumer_dsn, topology)

    def consume(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [outbox_script(), "consume", *args],
            cwd=tmp_path,
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=60,
        )

    assert_one_clear_error(consume("nowhere:fn"), 2, "cannot import module 'nowhere'", "hint:")
    assert_one_clear_error(consume("handlers:missing"), 2, "has no 'missing'")
    assert_one_clear_error(
        consume("handlers:on_order", OUTBOX_QUEUE=f"{topology.queue}.none"), 4, "does not exist"
    )
    assert_one_clear_error(
        consume("handlers:on_order", OUTBOX_DSN="postgresql://127.0.0.1:1/x"), 3, "PostgreSQL"
    )
    assert_one_clear_error(
        consume("handlers:on_order", OUTBOX_AMQP_URL="amqp://guest:guest@127.0.0.1:1/%2F"),
        3,
        "RabbitMQ",
    )
    no_handler = consume()
    assert no_handler.returncode == 2 and "MODULE:FUNCTION" in no_handler.stderr


def test_consume_cli__help_shows_every_option_with_its_variable() -> None:
    result = run_cli("consume", "--help")
    assert result.returncode == 0
    for variable in (
        "OUTBOX_QUEUE",
        "OUTBOX_DSN",
        "OUTBOX_AMQP_URL",
        "OUTBOX_PREFETCH",
        "OUTBOX_INBOX_TABLE",
        "OUTBOX_MAX_ATTEMPTS",
        "OUTBOX_INBOX_RETENTION",
        "OUTBOX_METRICS_PORT",
    ):
        assert variable in result.stdout, variable


def test_parked_cli__list_retry_after_the_fix_and_purge(
    consumer_dsn: str, topology: Topology, tmp_path: Path
) -> None:
    (tmp_path / "handlers.py").write_text(HANDLER_FILE)
    bad = new_ids(2)
    publish(topology, [(m, b'{"id": 1}') for m in bad])
    env = consume_env(consumer_dsn, topology, OUTBOX_MAX_ATTEMPTS="2")
    proc = subprocess.Popen(
        [outbox_script(), "consume", "handlers:always_fails"],
        cwd=tmp_path,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        def parked_now() -> list[dict[str, object]]:
            listed = run_cli("parked", "list", "--json", env=env)  # exit 4 until the tables exist
            return json.loads(listed.stdout)["parked"] if listed.returncode == 0 else []

        wait_for(lambda: len(parked_now()) == 2, 30, "both messages to be parked")
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    assert "2 parked" in stderr

    listed = json.loads(run_cli("parked", "list", "--json", env=env).stdout)["parked"]
    assert sorted(e["message_id"] for e in listed) == sorted(bad)
    assert all(e["attempts"] == 2 and "the handler is broken" in e["error"] for e in listed)
    text = run_cli("parked", "list", env=env).stdout
    assert bad[0] in text and "ValueError: the handler is broken" in text

    unknown = run_cli("parked", "retry", bad[0], "not-parked", env=env)
    assert unknown.returncode == 1 and "not parked: not-parked" in unknown.stderr
    assert "1 parked messages sent back" in unknown.stdout
    assert ready_messages(topology) == 1

    missing_table = run_cli("parked", "list", env={**env, "OUTBOX_INBOX_TABLE": "nothing_here"})
    assert_one_clear_error(missing_table, 4, "nothing_here_parked does not exist")
    purged = run_cli("parked", "purge", "--all", env=env)
    assert purged.returncode == 0 and "1 parked messages purged" in purged.stdout
    assert json.loads(run_cli("parked", "list", "--json", env=env).stdout)["parked"] == []
    usage = run_cli("parked", "purge", env=env)
    assert usage.returncode == 2

    fixed = subprocess.Popen(  # the fix: a handler that works; the retried one is applied
        [outbox_script(), "consume", "handlers:on_order"],
        cwd=tmp_path,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: effects(consumer_dsn) == [(bad[0], b"1")], 30)
    finally:
        fixed.send_signal(signal.SIGTERM)
        fixed.communicate(timeout=30)
    assert ready_messages(topology) == 0


def test_demo_consume__duplicates_and_a_kill_9_still_give_one_effect_per_row(
    pg_server: str, amqp_url: str
) -> None:
    result = run_cli(
        "demo", "--consume", "--dsn", pg_server, "--amqp-url", amqp_url, "--rows", "400"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "killed it with SIGKILL after" in result.stdout
    # The 100 copies (and whatever the killed consumer committed but never acked).
    skipped = re.search(r"(\d+) duplicates skipped", result.stdout)
    assert skipped and int(skipped[1]) >= 100, result.stdout
    assert "effects: 400 rows for 400 committed rows: 0 missing, 0 applied twice" in result.stdout
    assert "OK: every committed row had exactly one effect" in result.stdout
