"""``outbox bench --soak``: its fault schedule and per-window figures (pure)."""

from __future__ import annotations

import pathlib

from outbox.bench import soak
from outbox.bench.soak import MIN_FAULT_INTERVAL, SoakOptions, fault_schedule, soak_windows
from outbox.config import Settings


def test_soak_schedule__an_hour_has_a_fault_every_five_minutes_in_turn() -> None:
    o = SoakOptions(seconds=3600)
    assert (o.window, o.fault_interval, o.snapshot_seconds) == (300, 300, 600)
    plan = fault_schedule(o.seconds, o.fault_interval)
    assert [at for at, _ in plan] == [300.0 * k for k in range(1, 12)]
    assert [kind for _, kind in plan[:4]] == [
        "relay-kill",
        "broker-restart",
        "postgres-restart",
        "snapshot",
    ]


def test_soak_schedule__a_short_soak_still_gets_each_fault_and_time_to_recover() -> None:
    o = SoakOptions(seconds=30)
    assert o.fault_interval == MIN_FAULT_INTERVAL
    plan = fault_schedule(o.seconds, o.fault_interval)
    assert {kind for _, kind in plan} == {
        "relay-kill",
        "broker-restart",
        "postgres-restart",
        "snapshot",
    }
    assert max(at for at, _ in plan) <= o.seconds - o.fault_interval / 2


def test_soak_windows__latency_by_commit_time_and_throughput_by_arrival() -> None:
    committed = {"a": 0.5, "b": 1.5, "c": 1.6}
    arrived = {"a": 1.2, "b": 1.51, "c": 1.62}
    samples = [{"rss_bytes": 1, "open_files": 9, "dead_rows": 10}] * 2
    first, second = soak_windows(committed, arrived, 0.0, 1.0, samples)
    assert (first["p50_ms"], first["msg_per_s"]) == (700.0, 0.0)
    assert (second["msg_per_s"], second["open_files"]) == (3.0, 9)
    assert second["p50_ms"] == 20.0 and second["p99_ms"] == 20.0


def test_soak_relay__keeps_each_relays_log_and_reads_its_tail(tmp_path: pathlib.Path) -> None:
    """The soak keeps every relay's log (one file per relay, a killed relay's too),
    and can print the running one's tail when a window has no throughput.  The
    relay here fails at once (no server answers): its log says why."""
    settings = Settings(
        dsn="postgresql://nobody@127.0.0.1:1/none",
        amqp_url="amqp://guest:guest@127.0.0.1:1/%2F",
        connect_timeout=1.0,
    )
    relay = soak.Relay(settings, str(tmp_path))
    try:
        relay.current.procs[0].wait(timeout=60)
        tail = relay.log_tail()
        assert "127.0.0.1" in tail and "-- relay 0" in tail, tail
        relay.kill()
        relay.current.procs[0].wait(timeout=60)
    finally:
        relay.stop()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["relay-0-0.log", "relay-1-0.log"]
    assert all(p.stat().st_size > 0 for p in tmp_path.iterdir())
