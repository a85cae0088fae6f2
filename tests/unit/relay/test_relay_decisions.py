"""The relay's pure decisions."""

from __future__ import annotations

import pytest

from outbox.errors import (
    BrokerUnavailable,
    DatabaseUnavailable,
    OutboxError,
    OutcomeUnknown,
    PreparedSlotsExhausted,
)
from outbox.relay.batches import survives_failure


@pytest.mark.parametrize(
    ("error", "survives"),
    [
        (DatabaseUnavailable("work connection lost"), True),
        (OutcomeUnknown("PREPARE of the next batch cut off"), True),
        (PreparedSlotsExhausted("no slot for the next batch"), True),
        (BrokerUnavailable("confirms in doubt"), False),
    ],
)
def test_survives_failure__published_batch_outlives_database_failures_only(
    error: OutboxError, survives: bool
) -> None:
    assert survives_failure(error) is survives
