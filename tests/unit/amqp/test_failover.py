import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox import backoff
from outbox.amqp import failover


@given(st.integers(1, 9), st.one_of(st.none(), st.integers(0, 8)))
def test_rotation__tries_every_node_once(nodes: int, after: int | None) -> None:
    order = failover.rotation(nodes, after=None if after is None else after % nodes)
    assert sorted(order) == list(range(nodes))


def test_rotation__starts_at_the_first_node_then_after_the_one_that_failed() -> None:
    assert failover.rotation(3, after=None) == [0, 1, 2]
    assert failover.rotation(3, after=0) == [1, 2, 0]
    assert failover.rotation(3, after=2) == [0, 1, 2]
    assert failover.rotation(1, after=0) == [0]


def test_rotation__needs_a_node() -> None:
    with pytest.raises(ValueError):
        failover.rotation(0, after=None)


@given(st.integers(0, 200), st.booleans(), st.floats(0.01, 5), st.floats(5, 3600))
def test_reconnect_delay__one_node_is_the_plain_backoff(
    attempt: int, node_lost: bool, initial: float, maximum: float
) -> None:
    delay = failover.reconnect_delay(
        attempt,
        nodes=1,
        node_lost=node_lost,
        initial=initial,
        maximum=maximum,
        rng=random.Random(attempt),
    )
    assert delay == backoff.delay(
        attempt, initial=initial, maximum=maximum, rng=random.Random(attempt)
    )


@given(
    st.integers(0, 200),
    st.integers(2, 7),
    st.booleans(),
    st.floats(0.01, 60),
    st.floats(0.01, 3600),
)
def test_reconnect_delay__several_nodes_never_wait_more_than_half_a_second(
    attempt: int, nodes: int, node_lost: bool, initial: float, maximum: float
) -> None:
    delay = failover.reconnect_delay(
        attempt,
        nodes=nodes,
        node_lost=node_lost,
        initial=initial,
        maximum=max(initial, maximum),
        rng=random.Random(attempt),
    )
    assert 0 <= delay <= failover.ROUND_DELAY_MAX
    assert delay <= max(initial, maximum)


def test_reconnect_delay__a_lost_node_is_left_for_the_next_at_once_then_backs_off() -> None:
    rng = random.Random(7)
    delays = [
        failover.reconnect_delay(attempt, nodes=3, node_lost=True, initial=0.2, maximum=30, rng=rng)
        for attempt in range(12)
    ]
    assert delays[0] == 0.0
    # Not a busy loop: a connection that opens and drops again waits between rounds.
    assert all(d >= 0.1 for d in delays[1:])
    assert 0.1 <= delays[1] <= 0.2
    assert min(delays[6:]) >= failover.ROUND_DELAY_MAX / 2
    assert max(delays) <= failover.ROUND_DELAY_MAX


def test_reconnect_delay__a_failure_on_a_live_connection_is_not_retried_at_once() -> None:
    # A nack or a ledger that takes no records yet: every node is probably in the
    # same state, so the first retry waits like any other.
    delay = failover.reconnect_delay(
        0, nodes=3, node_lost=False, initial=0.2, maximum=30, rng=random.Random(1)
    )
    assert 0.1 <= delay <= 0.2


def test_reconnect_delay__a_smaller_backoff_max_still_rules() -> None:
    delays = [
        failover.reconnect_delay(a, nodes=2, node_lost=False, initial=0.05, maximum=0.3)
        for a in range(20)
    ]
    assert max(delays) <= 0.3


def test_reconnect_delay__rejects_negative_attempts() -> None:
    with pytest.raises(ValueError):
        failover.reconnect_delay(-1, nodes=2, node_lost=True, initial=0.1, maximum=1)
