"""The documentation site builds strictly: ``mkdocs build --strict`` (as CI runs it).

A broken link or anchor, a page missing from the navigation, a snippet whose file is
gone, or a docstring reference mkdocstrings cannot resolve fails the build, and so
this test.  It takes a few seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def build(site: Path, config: Path = ROOT / "mkdocs.yml") -> subprocess.CompletedProcess[str]:
    mkdocs = [sys.executable, "-m", "mkdocs"]
    return subprocess.run(
        [*mkdocs, "build", "--strict", "--config-file", str(config), "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
        timeout=120,
    )


def test_docs__the_site_builds_strictly_with_the_cli_and_api_pages(tmp_path: Path) -> None:
    result = build(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    cli = (tmp_path / "reference" / "cli" / "index.html").read_text()
    for command in ("init", "relay", "resolve", "status", "dead-letters", "consume"):
        assert f'id="outbox-{command}"' in cli, f"no generated section for outbox {command}"
    for command in ("parked", "demo", "bench", "web", "dead-letters-retry"):
        assert f'id="outbox-{command}"' in cli, f"no generated section for outbox {command}"
    api = (tmp_path / "reference" / "api" / "index.html").read_text()
    for name in (
        "outbox.enqueue.enqueue",
        "outbox.enqueue.enqueue_json_async",
        "outbox.inbox.consume",
    ):
        assert f'id="{name}"' in api, f"no API entry for {name}"
    for name in ("outbox.inbox.consume", "outbox.integrations.sqlalchemy.enqueue_json"):
        assert f'id="{name}"' in api, f"no API entry for {name}"


def test_docs__a_broken_anchor_fails_the_build(tmp_path: Path) -> None:
    """The check above can fail: a link to a heading that does not exist aborts it."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[there](other.md#no-such-heading)\n")
    (docs / "other.md").write_text("# Other\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text("site_name: t\nvalidation:\n  anchors: warn\n")
    result = build(tmp_path / "site", config)
    assert result.returncode != 0
    assert "no-such-heading" in result.stdout + result.stderr
