"""How ``console-charts.png`` was made: a real relay and consumer under a varying load
for a few minutes, then the console's charts screenshotted in chromium.

    python docs/images/console_charts.py 7 docs/images/console-charts.png

It starts a private PostgreSQL cluster and uses the local RabbitMQ (guest/guest);
about one row in 150 goes to a missing exchange (a dead letter) and one order in 500
fails in the consumer's handler (parked after two attempts).  A report holds a
REPEATABLE READ snapshot through the middle half of the run: the MVCC horizon ages
and the outbox's dead rows pile up while it holds them.
"""

from __future__ import annotations

import math
import os
import pathlib
import subprocess
import sys
import time
import uuid
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
OUTBOX = str(pathlib.Path(sys.executable).parent / "outbox")


def handle(conn: Any, message: Any) -> None:
    """The consumer's handler: one order in 500 fails for good."""
    number = int(bytes(message.body).split(b"-")[-1])
    if number % 500 == 7:
        raise ValueError("no such customer")


def main(minutes: float, shot: str) -> None:
    import pika
    import psycopg
    from playwright.sync_api import sync_playwright

    from outbox.db.devcluster import PostgresCluster, free_port

    cluster = PostgresCluster()
    dsn = cluster.start()
    amqp = "amqp://guest:guest@127.0.0.1:5672/%2F"
    tag = uuid.uuid4().hex[:6]
    exchange, queue, ledger = f"demo.orders.{tag}", f"demo.billing.{tag}", f"demo.ledger.{tag}"
    channel = pika.BlockingConnection(pika.URLParameters(amqp)).channel()
    channel.exchange_declare(exchange, "topic", durable=True)
    channel.queue_declare(queue, durable=True)
    channel.queue_bind(queue, exchange, "#")
    channel.connection.close()
    env = {
        **os.environ,
        "OUTBOX_DSN": dsn,
        "OUTBOX_AMQP_URL": amqp,
        "OUTBOX_LEDGER_QUEUE": ledger,
        "PYTHONPATH": str(HERE),
    }
    subprocess.run([OUTBOX, "init"], env=env, check=True, capture_output=True)
    port = free_port()
    inbox = ["--inbox-table", "billing_inbox"]
    consume = ["consume", "--queue", queue, *inbox, "--max-attempts", "2"]
    quiet = subprocess.DEVNULL
    running = [
        subprocess.Popen([OUTBOX, "relay"], env=env, stderr=quiet),
        subprocess.Popen(
            [OUTBOX, *consume, "console_charts:handle"],
            env=env,
            stderr=quiet,
        ),
        subprocess.Popen([OUTBOX, "web", "--port", str(port), *inbox], env=env, stderr=quiet),
    ]
    started, rows = time.monotonic(), 0
    report = psycopg.connect(dsn)  # holds the horizon from a quarter to three quarters
    report.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while (elapsed := time.monotonic() - started) < minutes * 60:
                if elapsed >= minutes * 15 and report.info.transaction_status.name == "IDLE":
                    if elapsed < minutes * 45:
                        report.execute("SELECT count(*) FROM outbox")  # the snapshot
                elif elapsed >= minutes * 45 and report.info.transaction_status.name != "IDLE":
                    report.rollback()
                for _ in range(int(40 + 35 * math.sin(elapsed / 50))):  # rows a second
                    rows += 1
                    target = exchange if rows % 150 else f"missing.{tag}"
                    conn.execute(
                        "INSERT INTO outbox (exchange, routing_key, payload) "
                        "VALUES (%s, 'order.created', %s)",
                        [target, f"order-{rows}".encode()],
                    )
                time.sleep(1)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path="/usr/bin/chromium", args=["--headless", "--no-sandbox"]
            )
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"http://127.0.0.1:{port}/")
            page.locator("section.charts figure").first.wait_for()
            box = page.locator("section.charts").bounding_box()
            assert box is not None
            page.screenshot(path=shot, clip=box)
            browser.close()
        print(f"{rows} rows in {minutes:g} min; {shot}")
    finally:
        report.close()
        for process in running:
            process.terminate()
        for process in running:
            process.wait(20)
        cluster.destroy()
        channel = pika.BlockingConnection(pika.URLParameters(amqp)).channel()
        for name in (queue, ledger):
            channel.queue_delete(name)
        channel.exchange_delete(exchange)
        channel.connection.close()


if __name__ == "__main__":
    main(float(sys.argv[1]), sys.argv[2])
