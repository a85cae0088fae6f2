"""Suspects after a broker refusal: isolate, then dead-letter (a fake clock)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox.relay.isolation import CAPACITY, REFUSALS_ALONE, Suspects, refusal_code

CC = (
    "channel closed: 406 PRECONDITION_FAILED - invalid message: "
    '{unacceptable_type_in_header,"CC",signedint}'
)
FRAME = (
    "connection lost: 501 FRAME_ERROR - type 2, all octets = <<>>: {frame_too_large,200073,131064}"
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("reason", "code"),
    [
        (CC, 406),
        (FRAME, 501),
        ("channel closed: 403 ACCESS_REFUSED - cannot publish to internal exchange", 403),
        ("channel closed: 404 NOT_FOUND - no exchange 'x' in vhost '/'", 404),
        ("channel closed: 505 UNEXPECTED_FRAME - expected content header", 505),
        ("connection lost: 320 CONNECTION_FORCED - broker forced connection closure", None),
        ("channel closed: 541 INTERNAL_ERROR - queue down", None),
        ("channel closed: 506 RESOURCE_ERROR - queue limit", None),
        ("nacked by the broker", None),
        ("no confirm before the publish timeout", None),
        ("connection lost: Connection reset by peer", None),
        ("channel abandoned after a confirm timeout", None),
    ],
)
def test_refusal_code__only_what_a_publish_caused(reason: str, code: int | None) -> None:
    assert refusal_code(reason) == code


def test_suspects__a_row_refused_alone_twice_gets_the_brokers_reason() -> None:
    suspects = Suspects()
    for row_id in (1, 2, 3):
        suspects.refused(row_id, CC, alone=False)
    assert all(suspects.is_suspect(r) for r in (1, 2, 3))
    assert suspects.verdict(2) is None, "a refusal of a whole batch convicts nobody"

    suspects.clear([1])  # accepted alone
    suspects.refused(2, CC, alone=True)
    assert suspects.is_suspect(2) and suspects.verdict(2) is None
    suspects.refused(2, CC, alone=True)

    verdict = suspects.verdict(2)
    assert verdict is not None and "refused it 2 times" in verdict and "CC" in verdict
    assert not suspects.is_suspect(2), "a convicted row is no longer published"
    assert not suspects.is_suspect(1) and suspects.is_suspect(3)


def test_suspects__transient_failures_never_make_a_suspect() -> None:
    suspects = Suspects()
    for reason in ("nacked by the broker", "connection lost: timed out", "541 INTERNAL_ERROR - x"):
        for _ in range(5):
            suspects.refused(7, reason, alone=True)
    assert not suspects.is_suspect(7) and suspects.verdict(7) is None
    assert len(suspects) == 0


def test_suspects__forget_after_the_ttl_and_keep_within_capacity() -> None:
    clock = Clock()
    suspects = Suspects(ttl=60, capacity=3, clock=clock)
    for row_id in range(5):
        suspects.refused(row_id, CC, alone=False)
    assert len(suspects) == 3 and not suspects.is_suspect(0) and suspects.is_suspect(4)
    suspects.condemn(9, "unroutable: …")
    clock.now += 61
    assert len(suspects) == 0 and suspects.verdict(9) is None


def test_suspects__a_condemned_row_is_a_dead_letter_until_its_batch_commits() -> None:
    suspects = Suspects()
    suspects.condemn(5, "unroutable: exchange '' has no queue bound")
    assert suspects.verdict(5) == "unroutable: exchange '' has no queue bound"
    assert not suspects.is_suspect(5)
    suspects.clear([5])
    assert suspects.verdict(5) is None


@given(
    st.lists(
        st.tuples(st.integers(0, 20), st.sampled_from([CC, FRAME, "nacked"]), st.booleans()),
        max_size=60,
    )
)
def test_suspects__only_refusals_alone_convict(events: list[tuple[int, str, bool]]) -> None:
    suspects = Suspects()
    alone: dict[int, int] = {}
    for row_id, reason, isolated in events:
        suspects.refused(row_id, reason, alone=isolated)
        if isolated and reason != "nacked":
            alone[row_id] = alone.get(row_id, 0) + 1
    for row_id in range(21):
        convicted = alone.get(row_id, 0) >= REFUSALS_ALONE
        assert (suspects.verdict(row_id) is not None) is convicted
    assert len(suspects) <= CAPACITY
