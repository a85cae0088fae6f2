"""Fixtures of the fleet tests: several databases with the outbox on this session's
private cluster, a targets file, and ``outbox relay --targets`` as a subprocess."""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest
from psycopg import sql

from outbox.config import Settings
from tests.fixtures.faults import RelayProcess
from tests.fixtures.servers import Topology, drop_database

NewDatabase = Callable[..., str]


@pytest.fixture
def new_database(pg_server: str, pg_template: str) -> Iterator[NewDatabase]:
    """``new_database(schema=True)``: a fresh database (with the outbox unless
    ``schema=False``) on the private cluster; every one dropped after the test."""
    made: list[str] = []

    def make(*, schema: bool = True, name: str | None = None) -> str:
        name = name or f"f_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(pg_server, autocommit=True) as conn:
            template = sql.SQL(" TEMPLATE {}").format(sql.Identifier(pg_template))
            conn.execute(
                sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
                + (template if schema else sql.SQL(""))
            )
        made.append(name)
        return psycopg.conninfo.make_conninfo(pg_server, dbname=name)

    yield make
    for name in made:
        drop_database(pg_server, name)


class TargetsFile:
    """A targets file the test rewrites (a new file moved into place, as a
    ConfigMap update does)."""

    def __init__(self) -> None:
        fd, self.path = tempfile.mkstemp(prefix="outbox-targets-", suffix=".txt")
        os.close(fd)

    def write(self, *dsns: str) -> None:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path))
        with os.fdopen(fd, "w") as file:
            file.write("# the fleet's databases\n" + "".join(f"{d}\n" for d in dsns))
        os.replace(tmp, self.path)


@pytest.fixture
def targets_file() -> Iterator[TargetsFile]:
    targets = TargetsFile()
    yield targets
    with contextlib.suppress(OSError):
        os.unlink(targets.path)


@pytest.fixture
def run_fleet(settings: Settings) -> Iterator[Callable[..., RelayProcess]]:
    """``run_fleet(targets_path, **env)``: ``outbox relay --targets`` in a subprocess;
    killed after the test if still running."""
    started: list[RelayProcess] = []

    def run(targets: str, *, drain: bool = False, **env: str) -> RelayProcess:
        relay = RelayProcess(settings, drain=drain, extra_env={"OUTBOX_TARGETS": targets, **env})
        started.append(relay)
        return relay

    yield run
    for relay in started:
        relay.close()


__all__ = ["NewDatabase", "TargetsFile", "Topology"]
