"""The console over many databases (``outbox web --targets``): an overview of every
database, a database that cannot be read shown as such, and each database's own
pages and actions under /db/<name>/, on that database and no other."""

from __future__ import annotations

import pathlib
import re
from collections.abc import Iterator

import psycopg
import pytest

from outbox.config import Settings
from outbox.fleet.targets import TargetSource
from outbox.gid import new_relay_id
from outbox.web.app import WebConfig
from outbox.web.console import ConsoleConfig
from outbox.web.security import Credentials
from tests.fixtures.faults import prepared_left
from tests.fixtures.servers import Topology, insert_numbered_rows
from tests.fixtures.web import Console, csrf_headers, http, start_console
from tests.integration.ops.test_fleet_ops import (  # noqa: F401
    declare_ledger,
    fleet_databases,
    missing_database,
    write_targets,
)
from tests.integration.resolver.test_faults_resolver import prepare_batch
from tests.integration.web.test_lists import add_dead_letters


@pytest.fixture
def targets(fleet: dict[str, str], pg_server: str, tmp_path: pathlib.Path) -> pathlib.Path:
    missing = missing_database(pg_server)
    path = tmp_path / "targets"
    write_targets(path, [*fleet.values(), missing])
    return path


@pytest.fixture
def console(settings: Settings, targets: pathlib.Path) -> Iterator[Console]:
    config = WebConfig(
        ConsoleConfig((settings,), refresh_seconds=0.0),
        settings.amqp_url,
        Credentials(),
        targets=TargetSource(file=str(targets), interval=0.0, connect_timeout=3.0),
    )
    running = start_console(config)
    yield running
    running.stop()


def rows(page: str) -> dict[str, str]:
    """database -> state of each row of the overview."""
    found = re.findall(r'<tr class="(\w+)" data-database="([^"]+)"', page)
    return {name: state for state, name in found}


def test_web__the_overview_shows_every_database_and_the_one_that_cannot_be_read(
    settings: Settings,
    console: Console,
    fleet: dict[str, str],
) -> None:
    a, b, c = fleet
    insert_numbered_rows(fleet[a], "ex", 4)
    add_dead_letters(fleet[b], 2)
    status, page = http(console.url + "/")
    assert status == 200, page
    found = rows(page)
    assert found[a] == "ok" and found[b] == "attention" and found[c] == "ok"
    [missing] = [n for n in found if n.startswith("no_such_")]
    assert found[missing] == "error"
    assert "does not exist" in page
    assert f'href="/db/{b}/dead-letters">2</a>' in page
    assert "4 databases: 2 all good, 1 need attention, 1 cannot be read" in page
    status, panel = http(console.url + "/overview/panel")
    assert status == 200 and 'id="fleet-summary"' in panel


def test_web__each_database_has_its_pages_under_its_prefix(
    settings: Settings,
    console: Console,
    fleet: dict[str, str],
) -> None:
    a, b, _ = fleet
    add_dead_letters(fleet[b], 3)
    status, page = http(f"{console.url}/db/{b}/dead-letters")
    assert status == 200 and len(re.findall(r'<tr class="dead-letter"', page)) == 3
    assert f'href="/db/{b}/dead-letters/' in page and f'Database <code class="database">{b}' in page
    status, page = http(f"{console.url}/db/{a}/dead-letters")
    assert status == 200 and 'class="dead-letter"' not in page
    status, page = http(f"{console.url}/db/{b}/")
    assert status == 200 and 'id="backlog-outbox"' in page and f'href="/db/{b}/dead-letters' in page
    assert 'id="charts"' not in page  # no sampler reads fifty databases every 10 s
    # No database chosen, or one that is not a target: 404, never the default DSN's.
    assert http(f"{console.url}/dead-letters")[0] == 404
    assert http(f"{console.url}/db/not_a_target/dead-letters")[0] == 404


def test_web__an_action_acts_on_its_database_only(
    settings: Settings,
    topology: Topology,
    console: Console,
    fleet: dict[str, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    declare_ledger(settings)
    a, b, _ = fleet
    insert_numbered_rows(fleet[a], topology.exchange, 2)
    insert_numbered_rows(fleet[b], topology.exchange, 2)
    in_a, _ = prepare_batch(fleet[a], new_relay_id(), 1, 2)
    in_b, _ = prepare_batch(fleet[b], new_relay_id(), 1, 2)
    status, page = http(f"{console.url}/db/{a}/in-doubt")
    assert status == 200 and in_a in page and in_b not in page
    status, page = http(
        f"{console.url}/db/{a}/in-doubt/resolve",
        data={"table": "outbox"},
        headers={**csrf_headers(console), "Origin": console.url},
    )
    assert status == 200, page
    assert prepared_left(fleet[a]) == [] and prepared_left(fleet[b]) == [in_b]
    [logged] = [r for r in caplog.records if getattr(r, "event", "") == "web.resolved"]
    assert logged.fields["database"] == a  # type: ignore[attr-defined]


def test_web__a_database_added_to_the_targets_appears_without_a_restart(
    settings: Settings,
    console: Console,
    fleet: dict[str, str],
    targets: pathlib.Path,
    dsn: str,
) -> None:
    added = str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])
    assert added not in rows(http(console.url + "/")[1])
    targets.write_text(targets.read_text() + dsn + "\n")
    assert rows(http(console.url + "/")[1]).get(added) == "ok"
    assert http(f"{console.url}/db/{added}/in-doubt")[0] == 200


def test_web__a_database_is_looked_up_only_after_authentication(
    settings: Settings, fleet: dict[str, str], targets: pathlib.Path
) -> None:
    """Unauthenticated, a known and an unknown database get the same 401: the list of
    databases is not told to whoever asks."""
    a = next(iter(fleet))
    token = "fleet-token-for-the-test"
    config = WebConfig(
        ConsoleConfig((settings,)),
        settings.amqp_url,
        Credentials(token=token),
        targets=TargetSource(file=str(targets), interval=0.0),
    )
    running = start_console(config)
    try:
        for path in (f"/db/{a}/", "/db/not_a_target/", "/"):
            assert http(running.url + path)[0] == 401
        bearer = {"Authorization": f"Bearer {token}"}
        assert http(f"{running.url}/db/{a}/in-doubt", headers=bearer)[0] == 200
        assert http(f"{running.url}/db/not_a_target/", headers=bearer)[0] == 404
    finally:
        running.stop()
