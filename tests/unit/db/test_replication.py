from __future__ import annotations

import pytest

from outbox.db.replication import Replication, warning


@pytest.mark.parametrize(
    ("replication", "expected"),
    [
        (Replication(0, 0, 0), None),  # no standby: nothing to fail over to
        (Replication(1, 1, 0), None),
        (Replication(3, 1, 0), None),  # one synchronous standby is enough
        (Replication(2, 0, 0), "none synchronous"),
        (Replication(2, 0, 2), "cannot see"),
        (Replication(2, 0, 1), "none synchronous"),  # the visible one is async
    ],
)
def test_replication_warning(replication: Replication, expected: str | None) -> None:
    text = warning(replication)
    if expected is None:
        assert text is None
    else:
        assert text is not None and expected in text
