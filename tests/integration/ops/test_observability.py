"""Metrics and health endpoints of a relay, against the real servers."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql

from outbox.config import Settings
from outbox.probes import LIVENESS_PATH, METRICS_PATH, READINESS_PATH
from outbox.relay.metrics import RelayEndpoints as Endpoints
from outbox.relay.process import Relay
from tests.fixtures.servers import Topology
from tests.integration.relay.test_dead_letters import insert


def get(endpoints: Endpoints, path: str) -> tuple[int, str]:
    url = f"http://127.0.0.1:{endpoints.port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def scrape(endpoints: Any) -> dict[str, float]:
    """Every sample of /metrics by name (labels folded into the name).  A relay's
    samples carry the ``database`` label, its database's name: checked, then left
    out of the name."""
    status, text = get(endpoints, METRICS_PATH)
    assert status == 200
    relay = getattr(endpoints, "relay", None)
    database = psycopg.conninfo.conninfo_to_dict(relay.settings.dsn)["dbname"] if relay else None
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            if database is not None and sample.name.startswith("outbox_"):
                assert labels.pop("database") == database, sample
            labels = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


@pytest.fixture
def started_relay(settings: Settings) -> Iterator[Relay]:
    relay = Relay(settings)
    relay.start()
    yield relay
    relay.close()


@pytest.fixture
def endpoints(started_relay: Relay) -> Iterator[Endpoints]:
    served = Endpoints(started_relay, port=0, address="127.0.0.1", cache_seconds=0).start()
    yield served
    served.close()


def test_metrics__counters_and_histogram_after_a_drain(
    settings: Settings, topology: Topology, started_relay: Relay, endpoints: Endpoints
) -> None:
    for i in range(150):
        insert(settings.dsn, topology.exchange, f"k.{i}")
    insert(settings.dsn, f"{topology.exchange}.missing", "k")
    started_relay.run(drain=True)

    metrics = scrape(endpoints)

    assert metrics["outbox_messages_published_total"] == 150
    assert metrics["outbox_batches_total{outcome=committed}"] == 2
    assert metrics["outbox_batches_total{outcome=rolled_back}"] == 0
    assert metrics["outbox_dead_lettered_total"] == 1
    assert metrics["outbox_batch_duration_seconds_count"] == 2
    assert metrics["outbox_batch_duration_seconds_bucket{le=+Inf}"] == 2
    assert 0 < metrics["outbox_batch_duration_seconds_sum"] < 60
    assert metrics["outbox_backlog_rows"] == 0
    assert metrics["outbox_dead_letters"] == 1
    assert metrics["outbox_database_up"] == 1
    assert "process_cpu_seconds_total" in metrics


def test_metrics__database_figures_backlog_prepared_batches_and_live_relays(
    settings: Settings, topology: Topology, started_relay: Relay, endpoints: Endpoints
) -> None:
    with psycopg.connect(settings.dsn) as conn:
        conn.execute(
            "INSERT INTO outbox (exchange, routing_key, created_at) "
            "SELECT %s, 'k', now() - interval '100 seconds' FROM generate_series(1, 3)",
            [topology.exchange],
        )
    stuck = psycopg.connect(settings.dsn)  # a batch of a (pretend) relay, in doubt
    stuck.execute("SELECT 1")
    stuck.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal("obx:outbox:someone:1")))
    foreign = psycopg.connect(settings.dsn)  # another application's: not counted
    foreign.execute("SELECT 1")
    foreign.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal("app:tx:1")))
    time.sleep(1.1)

    metrics = scrape(endpoints)

    assert metrics["outbox_backlog_rows"] == 3
    assert 100 <= metrics["outbox_backlog_oldest_age_seconds"] < 200
    assert metrics["outbox_prepared_batches"] == 1
    assert 1 <= metrics["outbox_prepared_oldest_age_seconds"] < 60
    assert metrics["outbox_live_relays"] == 1
    assert metrics["outbox_broker_up"] == 1
    stuck.close()
    foreign.close()


def test_health__ready_and_live_when_both_servers_answer(endpoints: Endpoints) -> None:
    assert get(endpoints, READINESS_PATH) == (200, "ok\n")
    assert get(endpoints, LIVENESS_PATH) == (200, "ok\n")
    assert get(endpoints, "/nothing-here")[0] == 404


def test_health__not_ready_while_the_database_is_unreachable_but_still_live(
    settings: Settings, endpoints: Endpoints, pg_server: str
) -> None:
    dbname = psycopg.conninfo.conninfo_to_dict(settings.dsn)["dbname"]
    with psycopg.connect(pg_server, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(str(dbname))))
    status, body = get(endpoints, READINESS_PATH)
    assert status == 503
    assert "database:" in body
    assert get(endpoints, LIVENESS_PATH)[0] == 200
    assert scrape(endpoints)["outbox_database_up"] == 0


def test_health__not_ready_without_the_broker(started_relay: Relay, endpoints: Endpoints) -> None:
    started_relay.publisher.close()
    status, body = get(endpoints, READINESS_PATH)
    assert status == 503
    assert "broker: not connected" in body
    assert scrape(endpoints)["outbox_broker_up"] == 0


def test_health__not_ready_before_start_nor_after_a_failed_pass(settings: Settings) -> None:
    relay = Relay(settings)
    served = Endpoints(relay, port=0, address="127.0.0.1", cache_seconds=0).start()
    try:
        assert get(served, READINESS_PATH)[0] == 503
        relay.start()
        assert get(served, READINESS_PATH)[0] == 200
        relay.stats.last_error = "lost RabbitMQ while publishing"
        status, body = get(served, READINESS_PATH)
        assert (status, "last pass failed: lost RabbitMQ" in body) == (503, True)
    finally:
        served.close()
        relay.close()


def test_health__liveness_fails_when_the_loop_stops_going_round(endpoints: Endpoints) -> None:
    endpoints.relay.stats.last_progress = time.monotonic() - endpoints.liveness_limit - 1
    status, body = get(endpoints, LIVENESS_PATH)
    assert status == 503
    assert "has not gone round" in body


def test_health__readiness_follows_a_running_relay(
    settings: Settings, topology: Topology, started_relay: Relay, endpoints: Endpoints
) -> None:
    thread = threading.Thread(target=started_relay.run)
    thread.start()
    try:
        insert(settings.dsn, topology.exchange, "k")
        deadline = time.monotonic() + 10
        while started_relay.stats.messages_published == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert get(endpoints, READINESS_PATH)[0] == 200
        before = started_relay.stats.last_progress
        time.sleep(settings.poll_interval + 0.5)
        assert started_relay.stats.last_progress > before, "an idle relay still goes round"
    finally:
        started_relay.stop.set()
        thread.join(timeout=10)
    assert get(endpoints, READINESS_PATH)[0] == 503  # stopping
