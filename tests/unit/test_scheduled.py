"""Scheduled rows without a server: the checks of ``deliver_at``/``delay``, where the
mover's scan starts and how far it got, and when the relay moves next."""

from __future__ import annotations

import datetime
import uuid

import pytest

from outbox.db.scheduled import LOOK_BACK, SWEEP_INTERVAL, Moved, covered_after, scan_from
from outbox.enqueue import OutgoingMessage, insert_sql, row_params, write
from outbox.relay.scheduling import BUSY_RECHECK, MoveSchedule, due_in

T0 = datetime.datetime(2026, 12, 7, 12, 0, tzinfo=datetime.timezone.utc)


def message(**fields: object) -> OutgoingMessage:
    return OutgoingMessage(exchange="e", routing_key="k", payload=b"p", **fields)  # type: ignore[arg-type]


def test_row_params__a_row_without_a_time_is_the_row_of_before() -> None:
    assert len(row_params(message())) == 7
    assert "deliver_at" not in insert_sql("outbox")


def test_row_params__a_scheduled_row_carries_its_time_or_delay() -> None:
    assert row_params(message(deliver_at=T0))[7:] == (T0, datetime.timedelta(0))
    delay = datetime.timedelta(minutes=5)
    assert row_params(message(delay=delay))[7:] == (None, delay)
    assert "deliver_at" in insert_sql("outbox", scheduled=True)


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"deliver_at": T0, "delay": datetime.timedelta(1)}, ValueError),
        ({"deliver_at": T0.replace(tzinfo=None)}, ValueError),
        ({"deliver_at": "2026-12-07"}, TypeError),
        ({"delay": 5}, TypeError),
    ],
)
def test_row_params__refuses_an_ambiguous_time(fields: dict[str, object], error: type) -> None:
    with pytest.raises(error):
        row_params(message(**fields))


def test_write__one_insert_for_the_rows_due_now_one_for_the_scheduled() -> None:
    calls: list[tuple[int, bool]] = []
    ids = [uuid.uuid4() for _ in range(3)]
    written = write(
        lambda rows, scheduled: calls.append((len(rows), scheduled)),
        [
            message(message_id=ids[0]),
            message(message_id=ids[1], delay=datetime.timedelta(1)),
            message(message_id=ids[2]),
        ],
    )
    assert written == ids
    assert calls == [(2, False), (1, True)]


def test_scan_from__starts_past_what_is_moved_with_a_look_back() -> None:
    assert scan_from(T0, sweep=False) == T0 - LOOK_BACK
    assert scan_from(T0, sweep=True) < T0 - datetime.timedelta(days=365 * 1000)
    assert scan_from(None, sweep=False) == scan_from(T0, sweep=True)


def test_covered_after__a_full_move_covers_only_up_to_its_last_row() -> None:
    last = T0 - datetime.timedelta(seconds=30)
    assert covered_after(10, 10, last, T0) == last
    assert covered_after(9, 10, last, T0) == T0
    assert covered_after(0, 10, None, T0) == T0


def moved(rows: int, next_due: datetime.datetime | None) -> Moved:
    return Moved(rows=rows, covered=T0, next_due=next_due, now=T0)


def test_move_schedule__sleeps_until_the_next_due_time() -> None:
    plan = MoveSchedule()
    assert plan.sweep_now(100.0)
    plan.moved(moved(0, T0 + datetime.timedelta(seconds=5)), 100.0, swept=True, full=False)
    assert plan.idle_until(100.0) == 105.0
    assert plan.next_move == 100.0 + BUSY_RECHECK
    assert not plan.sweep_now(100.0 + SWEEP_INTERVAL - 1)
    plan.woken()
    assert plan.next_move == 0.0


def test_move_schedule__nothing_scheduled_waits_for_the_sweep() -> None:
    plan = MoveSchedule()
    plan.moved(moved(0, None), 100.0, swept=True, full=False)
    assert plan.idle_until(100.0) == 100.0 + SWEEP_INTERVAL
    assert due_in(moved(0, None)) is None
    assert due_in(moved(0, T0 - datetime.timedelta(seconds=1))) == 0.0


def test_move_schedule__a_full_move_moves_again_at_once() -> None:
    plan = MoveSchedule()
    plan.moved(moved(1000, T0), 100.0, swept=False, full=True)
    assert plan.next_move == 100.0


def test_move_schedule__a_failed_move_is_tried_again_after_a_pause_not_at_every_step() -> None:
    """A lock held on the outbox (an application's LOCK TABLE, a migration) fails the
    move after the relay's lock_timeout; the loop claims meanwhile and moves again
    after ``MOVE_RETRY`` seconds, so one held lock does not cost a wait per step."""
    from outbox.relay.scheduling import MOVE_RETRY

    schedule = MoveSchedule()
    schedule.failed(100.0)
    assert schedule.next_move == 100.0 + MOVE_RETRY
    schedule.woken()  # a NOTIFY still makes it try at once
    assert schedule.next_move == 0.0
