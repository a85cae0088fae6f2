"""What ``outbox init`` says while a step waits for a lock (pure)."""

from __future__ import annotations

from outbox.db import migrate

RELAY_GID = "obx:outbox:" + "ab" * 16 + ":7"


def holder(**fields: object) -> migrate.Holder:
    values: dict[str, object] = {
        "relation": "outbox",
        "gid": None,
        "pid": None,
        "application_name": "",
        "state": "",
        "seconds": 12.0,
    }
    values.update(fields)
    return migrate.Holder(**values)  # type: ignore[arg-type]


def wait(*holders: migrate.Holder, cancelled: int = 0) -> migrate.Blocked:
    return migrate.Blocked(
        step="migration 0003_ordering_keys.sql",
        attempt=3,
        waited=4.0,
        holders=holders,
        relay_claims_cancelled=cancelled,
    )


def test_describe_wait__a_relay_batch_names_its_gid_and_what_settles_it() -> None:
    line = migrate.describe_wait(wait(holder(gid=RELAY_GID)), "outbox", "RabbitMQ is down")
    assert line.startswith("migration 0003_ordering_keys.sql: waiting for prepared batch")
    assert repr(RELAY_GID) in line
    assert "a running relay or `outbox resolve` settles it" in line
    assert "(this init could not: RabbitMQ is down)" in line


def test_describe_wait__another_tables_or_applications_prepared_transaction_is_foreign() -> None:
    for gid in ("app-tx-1", "obx:billing:" + "ab" * 16 + ":1"):
        line = migrate.describe_wait(wait(holder(gid=gid)), "outbox")
        assert f"prepared transaction {gid!r}" in line
        assert "not a relay batch of 'outbox'" in line
        assert "COMMIT PREPARED or ROLLBACK PREPARED" in line


def test_describe_wait__a_session_and_another_init() -> None:
    line = migrate.describe_wait(
        wait(
            holder(pid=42, application_name="psql", state="idle in transaction"),
            holder(relation="the migration lock", pid=43, application_name="outbox-init"),
        ),
        "outbox",
    )
    assert "session pid 42 (psql, idle in transaction, transaction open 12 s) on outbox" in line
    assert "another outbox init (pid 43, outbox-init) to finish" in line


def test_describe_wait__names_three_holders_at_most_and_the_cancelled_claims() -> None:
    holders = [holder(gid=f"obx:outbox:{'ab' * 16}:{n}") for n in range(5)]
    line = migrate.describe_wait(wait(*holders, cancelled=2), "outbox")
    assert line.count("prepared batch") == 3 and "; 2 more" in line
    assert "2 relay claims queued behind it cancelled" in line


def test_describe_wait__nothing_held_for_long() -> None:
    line = migrate.describe_wait(wait(), "outbox")
    assert "held for a moment" in line


def test_retry_pause__grows_to_its_maximum_with_jitter() -> None:
    pauses = [migrate.retry_pause(attempt) for attempt in range(1, 30)]
    assert all(0 < p <= migrate.RETRY_PAUSE_MAX for p in pauses)
    assert migrate.retry_pause(1) <= migrate.RETRY_PAUSE_INITIAL
    assert min(pauses[10:]) >= migrate.RETRY_PAUSE_MAX / 2
