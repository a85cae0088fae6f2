"""``describe`` is called on whatever a handler raised: it never raises."""

from __future__ import annotations

import pytest

from outbox.db.inbox import describe


class _StrRaises(Exception):
    def __init__(self, raised: BaseException) -> None:
        self.raised = raised

    def __str__(self) -> str:
        raise self.raised


@pytest.mark.parametrize("raised", [SystemExit(9), KeyboardInterrupt(), ValueError("x")])
def test_describe__an_exception_whose_str_raises_anything_is_described(
    raised: BaseException,
) -> None:
    """A handler's exception whose __str__ raised SystemExit made `outbox consume` exit."""
    assert describe(_StrRaises(raised)) == "_StrRaises: (its message cannot be shown)"
