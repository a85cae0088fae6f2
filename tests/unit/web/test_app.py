"""The console's application as an ASGI callable, without a server or a database."""

from __future__ import annotations

import asyncio
import datetime
import html.parser
from typing import Any

from starlette.requests import Request

from outbox.config import Settings
from outbox.web import console
from outbox.web.app import WebConfig, create_app
from outbox.web.console import ConsoleConfig
from outbox.web.security import Credentials, CsrfKeys
from outbox.web.site import MAX_FORM_BYTES, Pages


def call(
    app: Any, method: str, path: str, headers: dict[str, str], client: str = "127.0.0.1"
) -> tuple[int, bytes]:
    """One request through the app; (status, body)."""
    status, _, body = call_with_headers(app, method, path, headers, client)
    return status, body


def call_with_headers(
    app: Any, method: str, path: str, headers: dict[str, str], client: str = "127.0.0.1"
) -> tuple[int, list[tuple[str, str]], bytes]:
    """One request through the app; (status, response headers, body)."""
    sent: list[dict[str, Any]] = []
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": (client, 50000),
        "server": ("127.0.0.1", 8310),
    }

    messages = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], [(k.decode(), v.decode()) for k, v in start["headers"]], body


def local_console(credentials: Credentials | None = None) -> Any:
    # A DSN nothing listens on: these requests must not need the database.
    settings = Settings(dsn="postgresql://app@127.0.0.1:1/none")
    config = WebConfig(ConsoleConfig((settings,)), "amqp://localhost", credentials or Credentials())
    return create_app(config)


def test_web__without_credentials_a_request_for_another_host_name_is_refused() -> None:
    # DNS rebinding: evil.example re-pointed at 127.0.0.1 makes the console the
    # page's own origin (it could read every page and pass the Origin check).
    app = local_console()
    status, body = call(app, "GET", "/static/console.css", {"host": "evil.example:8310"})
    assert status == 421 and b"OUTBOX_WEB_TOKEN" in body
    status, _ = call(
        app,
        "POST",
        "/in-doubt/resolve",
        {"host": "evil.example:8310", "origin": "http://evil.example:8310"},
    )
    assert status == 421
    for host in ("127.0.0.1:8310", "localhost:8310", "[::1]:8310"):
        assert call(app, "GET", "/static/console.css", {"host": host})[0] == 200


def test_web__with_credentials_any_host_name_may_come_in_with_them() -> None:
    app = local_console(Credentials(token="t0ken-value"))
    headers = {"host": "console.example:8310"}
    assert call(app, "GET", "/static/console.css", headers)[0] == 401
    headers["authorization"] = "Bearer t0ken-value"
    assert call(app, "GET", "/static/console.css", headers)[0] == 200


class FormInputs(html.parser.HTMLParser):
    """The inputs and buttons of a page, as a browser's parser finds them."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs: list[dict[str, str | None]] = []
        self.buttons: list[dict[str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "input":
            self.inputs.append(dict(attrs))
        elif tag == "button":
            self.buttons.append(dict(attrs))


def test_web__a_confirmation_posts_rows_back_by_number_whatever_their_keys_look_like() -> None:
    # The page as a whole went through the redaction's shapes after escaping:
    # `password=\S+` ate the markup behind the key up to the next blank, so the
    # hidden field swallowed the confirm button.  Keys are now named by the numbers
    # of their rows: no text that masking changes is posted back.
    config = WebConfig(
        ConsoleConfig((Settings(dsn="postgresql://app@127.0.0.1:1/none"),)),
        "amqp://localhost",
        Credentials(),
    )
    pages = Pages(config)
    request = Request({"type": "http", "method": "GET", "path": "/", "headers": []})
    keys = ("password=k1", "tenant x://a:b@c", "order-7")
    page = pages.render(
        request,
        "confirm_dead_letters.html",
        limit=10,
        table="outbox",
        action="retry",
        row_ids=(),
        key_of=[1, 2, 3],
        keys=3,
        by_reason=False,
        rows=[
            {
                "id": n,
                "message_id": "m",
                "ordering_key": console.shown(key),
                "failed_at": datetime.datetime(2026, 1, 1),
                "reason": "r",
            }
            for n, key in enumerate(keys, 1)
        ],
    )
    found = FormInputs()
    found.feed(bytes(page.body).decode())
    assert [i["value"] for i in found.inputs if i.get("name") == "key_of"] == ["1", "2", "3"]
    assert [b.get("id") for b in found.buttons] == ["confirm"]
    assert "password=k1" not in bytes(page.body).decode()


def test_web__two_consoles_on_one_host_keep_their_own_csrf_cookies() -> None:
    # Cookies ignore the port: two consoles (one per database) on 127.0.0.1 shared
    # one cookie, each replaced the other's on every request (the overview reloads
    # itself every 5 s), and every confirmation in the other tab was refused as
    # "wrong CSRF token".
    app = local_console()

    def cookie_names(host: str) -> list[str]:
        _, headers, _ = call_with_headers(app, "GET", "/static/console.css", {"host": host})
        return [v.split("=")[0] for k, v in headers if k == "set-cookie"]

    assert cookie_names("127.0.0.1:8310") == ["outbox_csrf_8310"]
    assert cookie_names("localhost:8311") == ["outbox_csrf_8311"]
    assert cookie_names("localhost") == ["outbox_csrf"]


class Upload:
    """An ASGI ``receive`` that streams a large body in 64 KiB chunks and counts
    how much of it the application read."""

    def __init__(self, size: int | None) -> None:
        self.size = size  # None: endless
        self.read = 0

    async def __call__(self) -> dict[str, Any]:
        chunk = 64 * 1024
        if self.size is not None and self.read >= self.size:
            return {"type": "http.disconnect"}
        self.read += chunk
        return {"type": "http.request", "body": b"i" * chunk, "more_body": True}


def post_upload(app: Any, headers: dict[str, str], upload: Upload) -> tuple[int, bytes]:
    sent: list[dict[str, Any]] = []
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/dead-letters/purge",
        "raw_path": b"/dead-letters/purge",
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8310),
    }

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, upload, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], body


def test_web__a_large_post_is_refused_before_its_body_is_read() -> None:
    """A 105 MB cross-origin POST raised the console's RSS from 53 to 160 MB before
    its 403: the form was read before the Origin and CSRF checks."""
    keys = CsrfKeys()
    settings = Settings(dsn="postgresql://app@127.0.0.1:1/none")
    app = create_app(
        WebConfig(ConsoleConfig((settings,)), "amqp://localhost", Credentials()), csrf_keys=keys
    )
    big = str(105 * 1024 * 1024)
    base = {"host": "127.0.0.1:8310", "content-type": "application/x-www-form-urlencoded"}
    cookie = keys.issue()
    cases = [
        ({**base, "origin": "http://evil.example", "content-length": big}, 403),
        ({**base, "content-length": big}, 403),  # no CSRF cookie
        ({**base, "cookie": "outbox_csrf_8310=forged.cookie", "content-length": big}, 403),
        ({**base, "cookie": f"outbox_csrf_8310={cookie}", "content-length": big}, 413),
    ]
    for headers, status in cases:
        upload = Upload(105 * 1024 * 1024)
        assert post_upload(app, headers, upload)[0] == status, headers
        assert upload.read == 0, headers
    # Without a Content-Length (chunked): reading stops just past the limit.
    upload = Upload(None)
    status, body = post_upload(app, {**base, "cookie": f"outbox_csrf_8310={cookie}"}, upload)
    assert status == 413 and b"longer than" in body
    assert upload.read <= MAX_FORM_BYTES + 64 * 1024


def test_web__every_tab_shares_one_reading_of_the_overview(monkeypatch: Any) -> None:
    """Each open tab re-read the database every refresh (0.5 s in the tests, 5 s by
    default): ten tabs, ten times the queries.  Now one reading per interval."""
    from outbox.web import console as console_module

    readings = []

    def overview(config: ConsoleConfig) -> dict[str, Any]:
        readings.append(config)
        return {"outboxes": [], "inboxes": []}

    monkeypatch.setattr(console_module, "overview", overview)
    settings = Settings(dsn="postgresql://app@127.0.0.1:1/none")
    app = create_app(
        WebConfig(
            ConsoleConfig((settings,), refresh_seconds=60, sample_seconds=3600),
            "amqp://localhost",
            Credentials(),
        )
    )
    for _ in range(5):
        status, page = call(app, "GET", "/overview/panel", {"host": "127.0.0.1:8310"})
        assert status == 200, page[:300]
    assert len(readings) == 1


def test_web__failed_attempts_are_throttled_per_client() -> None:
    """About 860 wrong guesses a second were answered on one connection."""
    app = local_console(Credentials(token="Kq3-vT9xZ2pLm8Rw4bN7"))
    wrong = {"host": "127.0.0.1:8310", "authorization": "Bearer guess"}
    right = {"host": "127.0.0.1:8310", "authorization": "Bearer Kq3-vT9xZ2pLm8Rw4bN7"}
    statuses = [call(app, "GET", "/static/console.css", wrong)[0] for _ in range(12)]
    assert statuses == [401] * 10 + [429] * 2
    status, headers, _ = call_with_headers(app, "GET", "/static/console.css", right)
    assert status == 429 and ("retry-after", "1") in headers  # not even looked at
    assert call(app, "GET", "/static/console.css", right, client="10.9.9.9")[0] == 200
