"""Per-key ordering, pure: waves and holding rows behind a key's dead letter."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from outbox.message import DeadLetter
from outbox.relay import ordering
from tests.fixtures.fakes import make_rows


def test_waves__the_nth_row_of_every_key_in_wave_n_unkeyed_rows_first() -> None:
    rows = make_rows(7, ordering_keys=["a", "a", "b", None, "a", "b", None])
    waves = ordering.waves(list(reversed(rows)))
    assert [[r.id for r in wave] for wave in waves] == [[1, 3, 4, 7], [2, 6], [5]]


def test_waves__no_key_is_one_wave_in_id_order() -> None:
    rows = make_rows(4)
    assert [[r.id for r in w] for w in ordering.waves(rows[::-1])] == [[1, 2, 3, 4]]
    assert ordering.waves([]) == []


@given(st.lists(st.sampled_from(["a", "b", "c", None]), max_size=40))
def test_waves__keep_each_keys_order_and_never_put_two_rows_of_a_key_together(
    keys: list[str | None],
) -> None:
    rows = make_rows(len(keys), ordering_keys=keys) if keys else []
    waves = ordering.waves(rows)
    assert sorted(r.id for w in waves for r in w) == [r.id for r in rows]
    flat = [r for w in waves for r in w]
    for key in {"a", "b", "c"}:
        ids = [r.id for r in flat if r.ordering_key == key]
        assert ids == sorted(ids)
    for wave in waves:
        keyed = [r.ordering_key for r in wave if r.ordering_key is not None]
        assert len(keyed) == len(set(keyed))


def test_hold__rows_behind_a_dead_letter_of_their_key_follow_it() -> None:
    rows = make_rows(6, ordering_keys=["a", "b", "a", None, "b", "a"])
    dead = [DeadLetter(rows[2], "bad")]  # row 3, key a
    first = ordering.blockers(dead)
    assert first == {"a": 3}
    held, free = ordering.hold([r for r in rows if r.id != 3], first)
    assert [d.row.id for d in held] == [6]
    assert "ordering key 'a' (row 3)" in held[0].reason and "--ordering-key" in held[0].reason
    assert [r.id for r in free] == [1, 2, 4, 5]  # row 1 of key a is earlier: it goes


def test_hold__the_claim_says_a_row_is_behind_an_older_dead_letter() -> None:
    [row, free_row] = make_rows(2, ordering_keys=["a", None])
    row = row._replace(held_by=0)
    held, free = ordering.hold([row, free_row], {})
    assert [d.row.id for d in held] == [1] and "(row 0)" in held[0].reason
    assert free == [free_row]


def test_blockers__the_first_dead_letter_of_each_key() -> None:
    rows = make_rows(4, ordering_keys=["a", "a", None, "b"])
    dead = [DeadLetter(r, "x") for r in reversed(rows)]
    assert ordering.blockers(dead) == {"a": 1, "b": 4}
