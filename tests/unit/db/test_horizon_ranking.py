"""Which holder of the MVCC horizon is named first (``outbox.db.horizon.ranked``)."""

from __future__ import annotations

from outbox.db.horizon import Holder, ranked


def session(pid: int, xmin_age: int, seconds: float) -> Holder:
    return Holder("session", f"pid {pid}", xmin_age, seconds, True, {})


def test_ranked__the_oldest_holder_by_transactions_comes_first() -> None:
    young = session(1, 10, 3600.0)
    old = session(2, 500, 1.0)
    assert sorted([young, old], key=ranked, reverse=True)[0] is old


def test_ranked__of_the_same_age_the_one_holding_longest_comes_first() -> None:
    """A snapshot taken while a prepared transaction runs has its xid as xmin: the
    same age in transactions, but it came later (the console's own statement)."""
    prepared = Holder("prepared_transaction", "billing-43", 42, 5.0, True, {})
    follower = session(1, 42, 0.2)
    for holders in ([follower, prepared], [prepared, follower]):
        assert sorted(holders, key=ranked, reverse=True)[0] is prepared
