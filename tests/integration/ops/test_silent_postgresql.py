"""Operator commands whose PostgreSQL stops answering at a later statement than the
first (the adversary's proxy stalls at the first): each still ends with one line and
exit 3, its session given up by the client deadline (``outbox.db.session``)."""

from __future__ import annotations

import pytest

from tests.integration.ops.test_tools_adversary import (
    cli_env,
    pg_host_port,
    proxied_dsn,
    stalling_proxy,
    started,
    still_running_after,
)

# The first bytes of the statement that reads the schema version (``migrate.current_version``),
# sent after the privileges check.
SCHEMA_VERSION_READ = b"SELECT max(version)"


@pytest.mark.parametrize("command", [["status"], ["resolve"]], ids=" ".join)
def test_a_postgresql_that_stops_answering_at_the_schema_version_ends_the_command(
    command: list[str], dsn: str
) -> None:
    host, port = pg_host_port(dsn)
    with stalling_proxy(host, port, SCHEMA_VERSION_READ) as proxy:
        env = cli_env(proxied_dsn(dsn, proxy))  # statement timeout 1 s: a 3 s deadline
        with started({"it": command}, env) as procs:
            hung = still_running_after(procs, 8)
        assert proxy.stalled == 1, "the proxy never saw the schema version read"
    assert hung == []
    it = procs["it"]
    assert it.returncode == 3, it.stderr
    assert "Traceback" not in it.stderr
    assert "error: PostgreSQL did not answer while reading the schema version" in it.stderr
