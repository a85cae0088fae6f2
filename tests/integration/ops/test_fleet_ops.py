"""``outbox status`` and ``outbox resolve`` over a fleet (``--targets`` / ``--discover``)
against a private cluster with several databases, one that does not exist, and a
server with prepared transactions disabled: each database reported on its own, none
stopping the others."""

from __future__ import annotations

import contextlib
import json
import pathlib
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outbox.amqp.publisher import Publisher
from outbox.config import Settings
from outbox.gid import new_relay_id
from tests.fixtures.faults import RelayProcess, prepared_left, rows_left, wait_for
from tests.fixtures.servers import Topology, insert_numbered_rows, run_cli, settings_env
from tests.integration.resolver.test_faults_resolver import prepare_batch

# The machine's own PostgreSQL (prepared transactions disabled), if it answers.
LOCAL_SERVER = "host=127.0.0.1 port=5432 dbname=postgres connect_timeout=2"


def local_server_answers() -> bool:
    try:
        with psycopg.connect(LOCAL_SERVER) as conn:
            row = conn.execute("SELECT current_setting('max_prepared_transactions')").fetchone()
            return bool(row and row[0] == "0")
    except psycopg.Error:
        return False


@pytest.fixture(name="fleet")
def fleet_databases(pg_server: str, pg_template: str) -> Iterator[dict[str, str]]:
    """Three databases with the outbox schema, named fo_<run>_a, _b, _c: name -> DSN."""
    run = uuid.uuid4().hex[:8]
    names = [f"fo_{run}_{x}" for x in "abc"]
    with psycopg.connect(pg_server, autocommit=True) as conn:
        for name in names:
            conn.execute(
                sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                    sql.Identifier(name), sql.Identifier(pg_template)
                )
            )
    yield {name: psycopg.conninfo.make_conninfo(pg_server, dbname=name) for name in names}
    with psycopg.connect(pg_server, autocommit=True) as conn:
        for name in names:
            for (gid,) in conn.execute(
                "SELECT gid FROM pg_prepared_xacts WHERE database = %s", [name]
            ).fetchall():
                with (
                    psycopg.connect(
                        psycopg.conninfo.make_conninfo(pg_server, dbname=name), autocommit=True
                    ) as db,
                    contextlib.suppress(psycopg.Error),
                ):
                    db.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def write_targets(path: pathlib.Path, dsns: list[str]) -> str:
    path.write_text("# the fleet\n" + "\n".join(dsns) + "\n")
    return str(path)


def missing_database(pg_server: str) -> str:
    """A DSN of the test server naming a database that does not exist."""
    return psycopg.conninfo.make_conninfo(pg_server, dbname=f"no_such_{uuid.uuid4().hex[:6]}")


def declare_ledger(settings: Settings) -> None:
    """The ledger stream, declared as a relay declares it (a resolver pass reads it)."""
    publisher = Publisher(settings.amqp_url)
    publisher.connect()
    publisher.declare_stream(settings.ledger_queue, settings.ledger_max_age)
    publisher.close()


def fleet_cli(settings: Settings, *args: str) -> tuple[int, dict[str, Any], str]:
    result = run_cli(*args, "--json", env=settings_env(settings), timeout=60)
    assert result.stdout, result.stderr
    return result.returncode, json.loads(result.stdout), result.stderr


def test_status__reports_every_database_and_the_down_ones_in_their_rows(
    settings: Settings, fleet: dict[str, str], pg_server: str, tmp_path: pathlib.Path
) -> None:
    a, b, c = fleet
    insert_numbered_rows(fleet[b], "ex", 7)
    missing = missing_database(pg_server)
    dsns = [*fleet.values(), missing]
    local = local_server_answers()
    if local:
        dsns.append(LOCAL_SERVER)
    targets = write_targets(tmp_path / "targets", dsns)

    code, report, _ = fleet_cli(settings, "status", "--targets", targets)

    assert code == 1
    entries = {d["database"]: d for d in report["databases"]}
    assert entries[b]["backlog_rows"] == 7
    assert entries[a]["backlog_rows"] == 0 and entries[a]["state"] == "ok"
    assert entries[c]["status"]["table"] == "outbox"  # the single-database report, whole
    [gone] = [e for e in entries.values() if e["database"].startswith("no_such_")]
    assert (gone["state"], gone["why"]) == ("error", "unreachable") and "does not exist" in gone[
        "error"
    ]
    assert gone["exit_code"] == 3
    assert "its DSN in the targets" in gone["hint"]  # not --dsn, which it did not use
    summary = report["summary"]
    assert summary["backlog_rows"] == 7
    assert summary["error"] == (2 if local else 1)
    if local:
        [disabled] = [e for e in entries.values() if e["database"] == "postgres"]
        assert "max_prepared_transactions" in disabled["error"]
    attention = report["attention"]
    assert any(p.startswith(f"{gone['database']}: cannot be read") for p in attention)


def test_status__a_fleet_that_is_all_good_exits_0_with_a_line_per_database(
    settings: Settings, fleet: dict[str, str], tmp_path: pathlib.Path
) -> None:
    targets = write_targets(tmp_path / "targets", list(fleet.values()))
    result = run_cli("status", "--targets", targets, env=settings_env(settings), timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    for name in fleet:
        assert any(line.startswith(name) and line.endswith("ok") for line in lines)
    assert lines[-1].startswith("3 databases: 3 all good, 0 need attention, 0 cannot be read")


def test_status__discovers_the_databases_a_pattern_names(
    settings: Settings, fleet: dict[str, str], pg_server: str
) -> None:
    run = next(iter(fleet)).rsplit("_", 1)[0]
    code, report, _ = fleet_cli(
        settings, "status", "--discover", pg_server, "--databases", f"{run}_*"
    )
    assert [d["database"] for d in report["databases"]] == sorted(fleet)
    assert code == 0


def test_resolve__resolves_each_database_and_reports_the_one_that_fails(
    settings: Settings,
    topology: Topology,
    fleet: dict[str, str],
    pg_server: str,
    tmp_path: pathlib.Path,
) -> None:
    declare_ledger(settings)
    a, b, _c = fleet
    insert_numbered_rows(fleet[a], topology.exchange, 3)
    gid, _ = prepare_batch(fleet[a], new_relay_id(), 1, 3)  # a relay that never registered
    missing = missing_database(pg_server)
    targets = write_targets(tmp_path / "targets", [*fleet.values(), missing])

    code, report, _ = fleet_cli(settings, "resolve", "--targets", targets)

    assert code == 1
    entries = {d["database"]: d for d in report["databases"]}
    [batch] = entries[a]["batches"]
    assert (batch["gid"], batch["action"], batch["outcome"]) == (gid, "rollback", "rolled_back")
    assert entries[b]["batches"] == [] and entries[b]["error"] is None
    assert [n for n in report["failed"]] == [n for n in entries if n.startswith("no_such_")]
    assert prepared_left(fleet[a]) == []

    text = run_cli("resolve", "--dry-run", "--targets", targets, env=settings_env(settings))
    assert text.returncode == 1
    assert text.stdout.splitlines()[-1] == "4 databases: 3 done, 1 failed"
    assert f"{b}: no prepared batch of this outbox" in text.stdout


def test_status__a_server_that_never_answers_costs_its_timeout_not_the_others(
    settings: Settings, fleet: dict[str, str], tmp_path: pathlib.Path
) -> None:
    """A target whose server accepts the connection and then says nothing (a hung
    host, a black-holing proxy): its row says so after --connect-timeout, and every
    other database is read."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    port = silent.getsockname()[1]
    try:
        hung = f"host=127.0.0.1 port={port} dbname=hung user=outbox"
        targets = write_targets(tmp_path / "targets", [*fleet.values(), hung])
        code, report, _ = fleet_cli(
            settings, "status", "--targets", targets, "--connect-timeout", "1"
        )
    finally:
        silent.close()
    assert code == 1
    states = {d["database"]: d["state"] for d in report["databases"]}
    assert states == {**dict.fromkeys(fleet, "ok"), "hung": "error"}


def test_status__over_a_running_fleet_idle_dormant_databases_need_no_attention(
    settings: Settings, topology: Topology, fleet: dict[str, str], tmp_path: pathlib.Path
) -> None:
    """With ``outbox relay --targets`` serving the databases: each database's live
    relay while it works, and an idle database gone dormant (its relay unregistered
    until a row comes) is all good, not "no relay"."""
    a, b, _ = fleet
    targets = write_targets(tmp_path / "targets", list(fleet.values()))
    insert_numbered_rows(fleet[a], topology.exchange, 20)
    relay = RelayProcess(
        settings, extra_env={"OUTBOX_TARGETS": targets, "OUTBOX_DORMANT_AFTER": "1"}
    )
    try:
        wait_for(lambda: rows_left(fleet[a]) == 0, 30, "the fleet to publish a's rows")

        def idle_everywhere() -> bool:
            _, report, _ = fleet_cli(settings, "status", "--targets", targets)
            return all(d["live_relays"] == 0 for d in report["databases"])

        wait_for(idle_everywhere, 30, "every database to go dormant")
        code, report, _ = fleet_cli(settings, "status", "--targets", targets)
        assert code == 0 and report["summary"]["ok"] == 3, report["attention"]
        insert_numbered_rows(fleet[b], topology.exchange, 5)  # wakes b's relay
        wait_for(lambda: rows_left(fleet[b]) == 0, 30, "the fleet to publish b's rows")
        code, report, _ = fleet_cli(settings, "status", "--targets", targets)
        assert code == 0, report["attention"]
    finally:
        relay.close()
