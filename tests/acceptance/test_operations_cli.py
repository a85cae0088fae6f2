"""``outbox relay --metrics-port --log-format json`` and ``outbox status``, as run by users."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import psycopg
from psycopg import sql

import outbox
from outbox.config import Settings
from outbox.db.devcluster import free_port
from outbox.gid import Gid, new_relay_id
from tests.acceptance.test_dead_letters_cli import add_dead_letter
from tests.fixtures.servers import Topology, run_cli, settings_env
from tests.integration.relay.test_dead_letters import insert

GONE_GID = str(Gid("outbox", new_relay_id(), 7))


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def wait_for(predicate: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise AssertionError("timed out")


def test_relay_cli__serves_metrics_and_probes_and_logs_one_json_object_per_line(
    settings: Settings, topology: Topology
) -> None:
    port = free_port()
    env = settings_env(settings)
    env.update(OUTBOX_METRICS_PORT=str(port), OUTBOX_LOG_FORMAT="json", OUTBOX_LOG_LEVEL="debug")
    script = os.path.join(os.path.dirname(sys.executable), "outbox")
    proc = subprocess.Popen(
        [script, "relay"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_for(lambda: http_get(port, "/readyz")[0] == 200)
        assert http_get(port, "/healthz") == (200, "ok\n")
        with psycopg.connect(settings.dsn) as conn:  # one transaction: one batch
            ids = outbox.enqueue_many(
                conn, [outbox.OutgoingMessage(topology.exchange, f"k.{i}", b"x") for i in range(5)]
            )
        database = psycopg.conninfo.conninfo_to_dict(settings.dsn)["dbname"]
        published = f'outbox_messages_published_total{{database="{database}"}} 5.0'
        wait_for(lambda: published in http_get(port, "/metrics")[1])
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    events = [json.loads(line) for line in stderr.splitlines()]  # every line is JSON
    names = [e["event"] for e in events]
    assert {"relay.registered", "broker.connected", "relay.endpoints", "relay.stopped"} <= set(
        names
    )
    [committed] = [e for e in events if e["event"] == "batch.committed"]
    assert committed["gid"].startswith("obx:outbox:")
    assert (committed["rows"], committed["published"], committed["dead"]) == (5, 5, 0)
    assert all({"ts", "level", "logger"} <= set(e) for e in events)
    assert sorted(p.message_id for _, p, _ in topology.messages()) == sorted(map(str, ids))


def test_relay_cli__metrics_port_in_use_is_a_usage_error(settings: Settings) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli(
            "relay",
            "--metrics-port",
            str(port),
            "--metrics-address",
            "127.0.0.1",
            env=settings_env(settings),
        )
    assert result.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr


def test_status__all_good_exits_0(settings: Settings) -> None:
    result = run_cli("status", env=settings_env(settings))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all good" in result.stdout


def test_status__json_reports_dead_letters_old_prepared_batch_and_stale_backlog(
    settings: Settings, topology: Topology
) -> None:
    add_dead_letter(settings.dsn)
    insert(settings.dsn, topology.exchange, "waiting")
    stuck = psycopg.connect(settings.dsn)
    stuck.execute("SELECT 1")
    stuck.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(GONE_GID)))
    time.sleep(1.1)

    result = run_cli(
        "status",
        "--json",
        "--max-prepared-age",
        "1",
        "--max-backlog-age",
        "1",
        env=settings_env(settings),
    )

    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["dead_letters"] == 1
    assert report["backlog_rows"] == 1
    assert [b["gid"] for b in report["prepared_batches"]] == [GONE_GID]
    assert report["oldest_prepared_age_seconds"] >= 1
    assert report["live_relays"] == 0
    problems = " | ".join(report["attention"])
    assert "prepared batch" in problems
    assert "dead letters" in problems
    assert "no relay is running" in problems
    text = run_cli("status", "--max-prepared-age", "1", env=settings_env(settings))
    assert text.returncode == 1 and "needs attention" in text.stdout
    stuck.close()


def test_status__old_backlog_needs_attention(settings: Settings, topology: Topology) -> None:
    with psycopg.connect(settings.dsn) as conn:
        conn.execute(
            "INSERT INTO outbox (exchange, routing_key, created_at) "
            "VALUES (%s, 'k', now() - interval '1 hour')",
            [topology.exchange],
        )
    env = settings_env(settings)
    # A live relay that is not making progress (registered, never runs a batch).
    from outbox.relay.process import Relay

    relay = Relay(settings)
    relay.start()
    try:
        result = run_cli("status", "--json", "--max-backlog-age", "600", env=env)
    finally:
        relay.close()
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["live_relays"] == 1
    # 3600 s, and a second or two more on a loaded machine
    assert any(re.search(r"oldest outbox row is 36\d\ds old", p) for p in report["attention"])
