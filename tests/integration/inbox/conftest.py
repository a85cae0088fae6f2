"""Fixtures shared by the consumer's integration tests."""

from __future__ import annotations

import pytest

from tests.integration.inbox.support import create_effects_table


@pytest.fixture
def consumer_dsn(empty_dsn: str) -> str:
    """The consumer's own database (not the outbox's), with the effect table."""
    return create_effects_table(empty_dsn)
