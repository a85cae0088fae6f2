"""The CLI's last line of defence: even a bug prints no password (``cli.main``)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from outbox import cli, redaction
from outbox.ops import status
from outbox.redaction import Redactor

DSN = "postgresql://obx:S3cr%2FetPG@127.0.0.1:5432/app"


@pytest.fixture(autouse=True)
def fresh_redactor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redaction, "_default", Redactor())


def crash_with_the_password(*_: Any, **__: Any) -> Any:
    raise RuntimeError("bug while reading S3cr/etPG and postgresql://obx:S3cr/etPG@db/app")


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exited:
        cli.main(list(args))
    return int(exited.value.code or 0), capsys.readouterr().err


def test_main__a_bug_is_exit_1_with_a_redacted_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(status, "collect", crash_with_the_password)
    code, stderr = run_main(capsys, "status", "--dsn", DSN)
    assert code == 1
    assert "Traceback" in stderr and "crash_with_the_password" in stderr
    assert "error: unexpected RuntimeError" in stderr and "report it" in stderr
    assert "S3cr" not in stderr


def test_main__a_bug_with_json_logs_is_one_json_object(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(status, "collect", crash_with_the_password)
    code, stderr = run_main(capsys, "status", "--dsn", DSN, "--log-format", "json")
    [line] = stderr.splitlines()
    entry = json.loads(line)
    assert code == 1 and entry["exit_code"] == 1 and entry["event"] == "cli.error"
    assert "crash_with_the_password" in entry["exception"]
    assert "S3cr" not in line


def test_main__no_arguments_still_shows_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, stderr = run_main(capsys)
    assert code == 2 and stderr.startswith("Usage: outbox") and "error:" not in stderr
