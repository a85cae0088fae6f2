"""``outbox demo``: the whole path on local servers, checked end to end."""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator

from outbox import enqueue_json
from outbox.config import Settings
from outbox.db import migrate, session
from outbox.db.devcluster import PostgresCluster
from outbox.demo import reader as consumer
from outbox.relay.process import Relay
from outbox.tables import table_names


@contextlib.contextmanager
def scratch_database(dsn: str | None, echo: Callable[[str], None]) -> Iterator[str]:
    if dsn:
        yield dsn
        return
    echo("starting a private PostgreSQL with max_prepared_transactions = 64 ...")
    with PostgresCluster() as cluster:
        echo(f"  {cluster.dsn} (data in {cluster.base_dir}, removed afterwards)")
        yield cluster.dsn


def run_demo(*, dsn: str | None, amqp_url: str, rows: int, echo: Callable[[str], None]) -> bool:
    suffix = uuid.uuid4().hex[:8]
    exchange, queue = f"outbox.demo.{suffix}", f"outbox.demo.{suffix}"
    with scratch_database(dsn, echo) as database:
        settings = Settings(
            dsn=database,
            amqp_url=amqp_url,
            table=f"outbox_demo_{suffix}",
            ledger_queue=f"outbox.demo.ledger.{suffix}",
        )
        conn = session.connect(database, application_name="outbox-demo")
        try:
            migrate.migrate(conn, settings.table)
            echo(f"created table {settings.table!r}; declaring exchange and queue {queue!r}")
            consumer.declare(amqp_url, exchange=exchange, queue=queue)
            sent = write_rows(conn, settings.table, exchange, rows, echo)
            started = time.monotonic()
            relay = Relay(settings)
            relay.start()
            stats = relay.run(drain=True)
            elapsed = time.monotonic() - started
            echo(
                f"relay drained the table: {stats.messages_published} messages in "
                f"{stats.batches_committed} batches, {elapsed:.2f}s "
                f"({stats.messages_published / max(elapsed, 1e-9):,.0f} msg/s)"
            )
            got = consumer.receive(amqp_url, queue, expected=len(sent), timeout=30)
            return _report(sent, got, echo)
        finally:
            with contextlib.suppress(Exception):
                consumer.delete(amqp_url, exchange=exchange, queue=queue)
                consumer.delete(amqp_url, queue=settings.ledger_queue)
            with contextlib.suppress(Exception):
                for name in table_names(settings.table):
                    conn.execute(f'DROP TABLE IF EXISTS "{name}" CASCADE')
            conn.close()


def write_rows(
    conn: session.Conn, table: str, exchange: str, rows: int, echo: Callable[[str], None]
) -> set[str]:
    sent: set[str] = set()
    with conn.transaction():
        cur = conn.execute(
            f'INSERT INTO "{table}" (exchange, routing_key, payload) '
            "SELECT %s, 'order.created', convert_to(format('{\"id\": %%s}', i), 'UTF8') "
            "FROM generate_series(1, %s) AS i RETURNING message_id",
            [exchange, rows // 2],
        )
        sent.update(str(r["message_id"]) for r in cur.fetchall())
    echo(f"committed {len(sent)} rows with plain SQL")
    with conn.transaction():
        for i in range(rows - rows // 2):
            sent.add(
                str(
                    enqueue_json(
                        conn,
                        exchange=exchange,
                        routing_key="order.paid",
                        body={"id": i},
                        table=table,
                    )
                )
            )
    echo(f"committed {rows - rows // 2} rows with outbox.enqueue_json")
    with contextlib.suppress(_Rollback), conn.transaction():
        enqueue_json(
            conn,
            exchange=exchange,
            routing_key="order.cancelled",
            body={"never": "sent"},
            table=table,
        )
        raise _Rollback
    echo("rolled back 1 transaction with a row: it must never be published")
    return sent


class _Rollback(Exception):
    pass


def _report(sent: set[str], got: list[consumer.Received], echo: Callable[[str], None]) -> bool:
    counts = Counter(m.message_id for m in got)
    missing = sent - counts.keys()
    unexpected = counts.keys() - sent
    duplicates = sum(n - 1 for n in counts.values() if n > 1)
    echo(
        f"consumer received {len(got)} messages: {len(sent) - len(missing)}/{len(sent)} "
        f"expected, {len(missing)} missing, {duplicates} duplicates, "
        f"{len(unexpected)} unexpected"
    )
    ok = not missing and not unexpected and not duplicates
    if got:
        sample = dataclasses.asdict(got[0])
        echo(
            f"one of them: message_id={sample['message_id']} "
            f"routing_key={sample['routing_key']} body={sample['body']!r} "
            f"delivery_mode={sample['properties'].get('delivery_mode')}"
        )
    echo("OK: every committed row arrived exactly once" if ok else "FAILED")
    return ok
