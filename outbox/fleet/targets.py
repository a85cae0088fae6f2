"""Which databases a fleet serves: a targets file, or a server and a rule.

Two sources, one shape (a list of ``Target``):

- a **targets file** (``--targets FILE``): one PostgreSQL DSN per line (a
  ``postgresql://`` URL or ``key=value`` pairs); blank lines and lines starting with
  ``#`` are ignored.  The file is read again whenever it changes (its modification
  time, size or inode: a Kubernetes ConfigMap mounted as a volume is replaced by a new
  file), so targets are added and removed without a restart;
- **discovery** (``--discover DSN --databases PATTERN``): every database of the
  server that ``DSN`` reaches whose name matches ``PATTERN`` (shell-style: ``*``,
  ``?``, ``[…]``; default every database) and that has the outbox table.  The list of
  databases is read from ``pg_database`` on each pass; a database is connected to
  once, to look for the table, when it first appears, and one without the table is
  looked at again later, less and less often (``RECHECK_SECONDS``).

A target's ``name`` is the ``database`` label of its metrics, logs and status: the
database name, or ``host:port/database`` when two targets share a database name.

Every function here but ``discover`` (and ``TargetSource.poll``, which calls it or
reads the file) is pure.  Nothing here connects to a target to serve it: that is the
fleet's work (``outbox.fleet``).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import time
from collections.abc import Iterable, Mapping, Sequence

from outbox import redaction, urls
from outbox.errors import InvalidSetting, OutboxError

# Discovery: a database seen without the outbox table is looked at again after
# these pauses (then every last one), so one created empty and migrated a moment
# later is found within seconds, and fifty databases that never get the table cost
# a connection each per minute.
RECHECK_SECONDS = (2.0, 5.0, 10.0, 30.0, 60.0)


@dataclasses.dataclass(frozen=True, order=True)
class Target:
    """One database the fleet serves."""

    name: str  # the ``database`` label (unique within a list)
    dsn: str = dataclasses.field(repr=False)  # may hold a password

    def __str__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class Changes:
    """What a new list of targets changes (``diff``)."""

    added: tuple[Target, ...] = ()
    removed: tuple[Target, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.added or self.removed)


def _settings(dsn: str) -> dict[str, str]:
    return urls.check_dsn(dsn)


_database = urls.dsn_database


def _server(settings: Mapping[str, str]) -> str:
    host = settings.get("host") or settings.get("hostaddr") or os.environ.get("PGHOST", "")
    port = settings.get("port") or os.environ.get("PGPORT", "5432")
    return f"{host or 'localhost'}:{port}"


def named(dsns: Iterable[str]) -> list[Target]:
    """Targets for ``dsns``, named by database (qualified by server where two share
    one); a DSN given twice (same server, database and user) counts once.  Raises
    ``InvalidSetting`` for a DSN that cannot be right (never quoting it)."""
    seen: dict[tuple[str, str, str], str] = {}
    for dsn in dsns:
        settings = _settings(dsn)
        key = (_server(settings), _database(settings), settings.get("user", ""))
        seen.setdefault(key, dsn)
    databases = [database for _, database, _ in seen]
    targets = []
    for (server, database, _user), dsn in seen.items():
        name = database if databases.count(database) == 1 else f"{server}/{database}"
        targets.append(Target(name, dsn))
    names = [t.name for t in targets]
    for target in targets:
        if names.count(target.name) > 1:
            raise InvalidSetting(
                f"two targets are the database {target.name} as different users",
                "list each database once",
            )
    return sorted(targets)


def parse_targets(text: str, *, source: str) -> list[Target]:
    """The targets a targets file's ``text`` lists; ``source`` names the file in errors.

    A line that is not a DSN raises ``InvalidSetting`` naming its line number and
    what is wrong, never its text (it may hold a password)."""
    dsns = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        redaction.remember(line)
        try:
            urls.check_dsn(line)
        except urls.InvalidUrl as exc:
            redaction.remember(line, refused=True)
            raise InvalidSetting(
                f"{source}, line {number}: not a PostgreSQL DSN: {exc}",
                "write one postgresql:// URL or key=value DSN per line",
            ) from None
        dsns.append(line)
    return named(dsns)


def read_targets(path: str) -> list[Target]:
    """The targets the file at ``path`` lists; ``InvalidSetting`` if it cannot be read."""
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise InvalidSetting(
            f"cannot read the targets file {path}: {reason}",
            "give --targets a readable UTF-8 file with one PostgreSQL DSN per line",
        ) from None
    return parse_targets(text, source=path)


def diff(current: Iterable[Target], new: Iterable[Target]) -> Changes:
    """What goes from ``current`` to ``new``: a target whose DSN changed is removed
    and added again (its relay reconnects with the new one)."""
    old, fresh = set(current), set(new)
    return Changes(added=tuple(sorted(fresh - old)), removed=tuple(sorted(old - fresh)))


def matches(database: str, pattern: str) -> bool:
    """Whether ``database`` matches the discovery rule's shell-style ``pattern``
    (several patterns: separated by commas)."""
    return any(
        fnmatch.fnmatchcase(database, part.strip()) for part in pattern.split(",") if part.strip()
    )


def target_dsn(server_dsn: str, database: str) -> str:
    """``server_dsn`` pointed at ``database`` (every other setting kept)."""
    from psycopg.conninfo import make_conninfo

    return make_conninfo(server_dsn, dbname=database)


@dataclasses.dataclass
class _Seen:
    has_table: bool
    next_check: float
    misses: int = 0


class TargetSource:
    """The fleet's targets, from a file or a discovery rule, looked at every
    ``interval`` seconds (``poll``).  ``current`` is the last list read."""

    def __init__(
        self,
        *,
        file: str | None = None,
        discover: str | None = None,
        pattern: str = "*",
        table: str = "outbox",
        interval: float = 5.0,
        connect_timeout: float = 10.0,
        statement_timeout: float = 30.0,
    ) -> None:
        if (file is None) == (discover is None):
            raise InvalidSetting(
                "give either a targets file or a server to discover databases on",
                "use --targets FILE or --discover DSN, not both",
            )
        self.file = file
        self.discover_dsn = discover
        self.pattern = pattern
        self.table = table
        self.interval = interval
        self.connect_timeout = connect_timeout
        self.statement_timeout = statement_timeout
        self.current: list[Target] = []
        self._stamp: tuple[float, int, int] | None = None
        self._next = 0.0
        self._seen: dict[str, _Seen] = {}

    def describe(self) -> str:
        if self.file is not None:
            return f"targets file {self.file}"
        return f"databases matching {self.pattern!r} with the table {self.table}"

    def poll(self, now: float | None = None) -> list[Target] | None:
        """The targets, if due for a look (``interval``) and changed since the last
        ``poll``; else None.  Raises ``OutboxError`` if the source cannot be read (the
        caller keeps the targets it has and tries again)."""
        now = time.monotonic() if now is None else now
        if now < self._next:
            return None
        self._next = now + self.interval
        if self.file is not None:
            try:
                info = os.stat(self.file)
            except OSError as exc:
                raise InvalidSetting(
                    f"cannot read the targets file {self.file}: {exc.strerror}",
                    "the fleet keeps serving the targets it has and looks again",
                ) from None
            stamp = (info.st_mtime, info.st_size, info.st_ino)
            if stamp == self._stamp:
                return None
            targets = read_targets(self.file)
            self._stamp = stamp
        else:
            targets = self._discover(now)
        if targets == self.current:
            return None
        self.current = targets
        return targets

    def _discover(self, now: float) -> list[Target]:
        assert self.discover_dsn is not None
        databases = [d for d in list_databases(self.discover_dsn, self) if matches(d, self.pattern)]
        self._seen = {d: s for d, s in self._seen.items() if d in databases}
        for database in databases:
            seen = self._seen.get(database)
            if seen is not None and (seen.has_table or now < seen.next_check):
                continue
            dsn = target_dsn(self.discover_dsn, database)
            try:
                has_table = has_outbox_table(dsn, self)
            except OutboxError:
                has_table = False  # down or refusing: looked at again later
            misses = 0 if has_table else (seen.misses + 1 if seen else 1)
            pause = RECHECK_SECONDS[min(misses, len(RECHECK_SECONDS)) - 1] if misses else 0.0
            self._seen[database] = _Seen(has_table, now + pause, misses)
        return named(
            target_dsn(self.discover_dsn, d) for d, s in sorted(self._seen.items()) if s.has_table
        )


def list_databases(server_dsn: str, source: TargetSource) -> list[str]:
    """The databases of the server that accept connections (templates left out)."""
    from outbox.db import session

    with session.connect(
        server_dsn,
        application_name="outbox-discover",
        connect_timeout=source.connect_timeout,
        statement_timeout=source.statement_timeout,
    ) as conn:
        rows = conn.execute(
            "SELECT datname FROM pg_database WHERE datallowconn AND NOT datistemplate "
            "ORDER BY datname"
        ).fetchall()
    return [str(row["datname"]) for row in rows]


def has_outbox_table(dsn: str, source: TargetSource) -> bool:
    """Whether the database ``dsn`` reaches has the outbox table (``source.table``)."""
    from outbox.db import session

    with session.connect(
        dsn,
        application_name="outbox-discover",
        connect_timeout=source.connect_timeout,
        statement_timeout=source.statement_timeout,
    ) as conn:
        row = conn.execute("SELECT to_regclass(%s) IS NOT NULL AS found", [source.table]).fetchone()
    return bool(row and row["found"])


def names(targets: Sequence[Target]) -> list[str]:
    return [t.name for t in targets]
