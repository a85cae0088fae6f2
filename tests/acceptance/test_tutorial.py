"""docs/tutorial/your-application.md, run as a reader runs it: every fenced block in
page order, and the output it shows compared with what the blocks print.

The page's servers (``postgresql://localhost/app``, ``amqp://guest:guest@localhost:5672/%2F``)
become a fresh database and a RabbitMQ virtual host of this test's own, so the page's
fixed names (``orders``, ``billing``, the ledger) meet nothing of another test.
``sh`` blocks run in bash with the installed ``outbox`` first on PATH, ``sql`` blocks
through psycopg, ``python`` blocks in one namespace (as one session would), and a
``text`` block is the output of the ``python`` block before it.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pika
import psycopg
import pytest

from tests.fixtures.docs import fenced_blocks

PAGE = "tutorial/your-application.md"
PAGE_DSN = "postgresql://localhost/app"
PAGE_AMQP_URL = "amqp://guest:guest@localhost:5672/%2F"


def rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture
def vhost_url(amqp_url: str) -> Iterator[str]:
    """The test broker's URL with a virtual host made for this test."""
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("rabbitmqctl is not installed: cannot make a private virtual host")
    params = pika.URLParameters(amqp_url)
    vhost = f"tutorial-{uuid.uuid4().hex[:10]}"
    rabbitmqctl("add_vhost", vhost)
    try:
        rabbitmqctl("set_permissions", "-p", vhost, params.credentials.username, ".*", ".*", ".*")
        base = amqp_url.rsplit("/", 1)[0]
        yield f"{base}/{quote(vhost, safe='')}"
    finally:
        rabbitmqctl("delete_vhost", vhost)


def test_tutorial__your_application_runs_as_written(
    empty_dsn: str, vhost_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks = fenced_blocks(PAGE)
    assert {lang for lang, _ in blocks} == {"sh", "python", "sql", "text"}
    page_text = "".join(text for _, text in blocks)
    assert PAGE_DSN in page_text and PAGE_AMQP_URL in page_text
    env = dict(os.environ, OUTBOX_DSN=empty_dsn, OUTBOX_AMQP_URL=vhost_url)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    monkeypatch.setenv("OUTBOX_DSN", empty_dsn)
    monkeypatch.setenv("OUTBOX_AMQP_URL", vhost_url)
    namespace: dict[str, Any] = {"__name__": "tutorial"}
    printed = None
    outputs_checked = 0
    for n, (lang, text) in enumerate(blocks):
        text = text.replace(PAGE_DSN, empty_dsn).replace(PAGE_AMQP_URL, vhost_url)
        where = f"{PAGE}, block {n + 1} ({lang})"
        if lang == "sh":
            run = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", text],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert run.returncode == 0, (where, run.stdout, run.stderr)
        elif lang == "sql":
            with psycopg.connect(empty_dsn) as conn:
                conn.execute(text)
        elif lang == "python":
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(text, where, "exec"), namespace)
            printed = out.getvalue()
        else:
            assert printed == text, (where, printed)
            outputs_checked += 1
    assert outputs_checked == 1
