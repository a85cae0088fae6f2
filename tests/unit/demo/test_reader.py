from hypothesis import given
from hypothesis import strategies as st

from outbox.demo.reader import Deduplicator


def test_deduplicator__drops_a_repeated_message_id() -> None:
    dedup = Deduplicator()
    assert dedup.first_time("a") is True
    assert dedup.first_time("b") is True
    assert dedup.first_time("a") is False


def test_deduplicator__forgets_the_least_recently_seen_beyond_capacity() -> None:
    dedup = Deduplicator(capacity=2)
    for message_id in ("a", "b", "a", "c"):  # "a" was seen again, so "b" is the oldest
        dedup.first_time(message_id)
    assert dedup.first_time("a") is False
    assert dedup.first_time("b") is True


@given(st.lists(st.sampled_from("abcdefgh"), max_size=60))
def test_deduplicator__with_room_for_all_ids_passes_each_exactly_once(ids: list[str]) -> None:
    dedup = Deduplicator(capacity=8)
    passed = [i for i in ids if dedup.first_time(i)]
    assert sorted(passed) == sorted(set(ids))
