"""``outbox web`` as users run it: it serves the console, logs JSON events, stops on
SIGTERM; it refuses a non-local bind without credentials."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request

from outbox.config import Settings
from outbox.db.devcluster import free_port
from tests.fixtures.faults import wait_for
from tests.fixtures.servers import run_cli, settings_env


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    try:
        request = urllib.request.Request(url, headers=headers or {})
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def test_web__serves_the_console_logs_who_may_use_it_and_stops_on_sigterm(
    settings: Settings,
) -> None:
    port = free_port()
    env = {k: v for k, v in settings_env(settings).items() if not k.startswith("OUTBOX_WEB_")}
    env["OUTBOX_WEB_TOKEN"] = "acceptance-t0ken"
    web = subprocess.Popen(
        [sys.executable, "-m", "outbox", "web", "--port", str(port), "--log-format", "json"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}/"
        wait_for(lambda: get(url)[0] == 401, 20, "the console to answer")
        status, page = get(url, {"Authorization": "Bearer acceptance-t0ken"})
        assert status == 200 and "Backlog" in page
        web.send_signal(signal.SIGTERM)
        assert web.wait(20) == 0
    finally:
        if web.poll() is None:
            web.kill()
            web.wait()
    assert web.stderr is not None
    events = [json.loads(line) for line in web.stderr.read().splitlines() if line.startswith("{")]
    started = next(e for e in events if e["event"] == "web.started")
    assert started["host"] == "127.0.0.1" and started["port"] == port and started["auth"] is True
    refused = [e for e in events if e["event"] == "web.refused"]
    assert refused and refused[0]["why"] == "not authenticated"
    assert all("acceptance-t0ken" not in json.dumps(e) for e in events)


def test_web__a_non_local_bind_without_credentials_refuses_to_start(settings: Settings) -> None:
    env = {k: v for k, v in settings_env(settings).items() if not k.startswith("OUTBOX_WEB_")}
    result = run_cli("web", "--host", "0.0.0.0", env=env, timeout=30)
    assert result.returncode == 2
    assert "OUTBOX_WEB_TOKEN" in result.stderr and "Traceback" not in result.stderr
    half = {**env, "OUTBOX_WEB_USER": "ops"}
    result = run_cli("web", "--host", "0.0.0.0", env=half, timeout=30)
    assert result.returncode == 2 and "OUTBOX_WEB_PASSWORD" in result.stderr
