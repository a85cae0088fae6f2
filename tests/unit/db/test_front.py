"""Which saved front a new session starts from (``outbox.db.front.resumed``), and the
safety net's schedule (``NetState``: ``begun``, ``recorded``)."""

from __future__ import annotations

import itertools

import pytest

from outbox.db.batches import chosen_front
from outbox.db.front import (
    RESCAN_SLICES,
    SLICE_PAGES_MIN,
    ClaimFront,
    Cluster,
    NetState,
    RescanPass,
    SavedFront,
    SliceRead,
    begun,
    next_pass_in,
    recorded,
    resumed,
)

HERE = Cluster(system_identifier=7, timeline=2, filenode=40, xmax=1_000)
FRONT = ClaimFront(low_water=500, late=(3, 9), seen="900:950:910")


def test_resumed__a_front_saved_here_is_the_start() -> None:
    assert resumed(SavedFront(FRONT, Cluster(7, 2, 40, 950)), HERE) == FRONT
    assert resumed(SavedFront(FRONT, Cluster(7, 2, 40, 1_000)), HERE) == FRONT


@pytest.mark.parametrize(
    "where",
    [
        Cluster(8, 2, 40, 950),
        Cluster(7, 1, 40, 950),
        Cluster(7, 3, 40, 950),
        Cluster(7, 2, 41, 950),
        Cluster(7, 2, 40, 1_001),
    ],
    ids=["another_cluster", "an_earlier_timeline", "a_later_timeline", "another_file", "ahead"],
)
def test_resumed__a_front_from_elsewhere_or_ahead_starts_from_the_bottom(where: Cluster) -> None:
    assert resumed(SavedFront(FRONT, where), HERE) == ClaimFront()


def test_resumed__nothing_saved_starts_from_the_bottom() -> None:
    assert resumed(None, HERE) == ClaimFront()
    assert resumed(SavedFront(ClaimFront(), Cluster(7, 2, 40, 950)), HERE) == ClaimFront()


def test_rescan_pass__covers_every_page_once_in_bounded_slices() -> None:
    for end in (0, 1, SLICE_PAGES_MIN, SLICE_PAGES_MIN + 1, RESCAN_SLICES * SLICE_PAGES_MIN * 3):
        rescan: RescanPass | None = RescanPass(end)
        slices = []
        while rescan is not None:
            slices.append(rescan.slice())
            rescan = rescan.after()
        assert slices[0][0] == 0 and slices[-1][1] == end
        assert all(a[1] == b[0] for a, b in itertools.pairwise(slices))
        assert len(slices) <= RESCAN_SLICES
        widths = [last - first for first, last in slices]
        assert max(widths) <= max(SLICE_PAGES_MIN, -(-end // RESCAN_SLICES))


def test_net__a_slice_counts_once_and_the_last_one_ends_the_pass() -> None:
    began = "2026-01-01 00:00:00+00"
    state = begun(NetState(), 600, 300, began)
    assert state.rescan() == RescanPass(300, 0)
    first = SliceRead(began, 0, 128, 2)
    again = recorded(recorded(state, (first,)), (first,))  # read by two relays
    assert (again.pass_at, again.pass_found) == (128, 2)
    stale = SliceRead("2025-01-01 00:00:00+00", 128, 256, 9)  # a pass that ended
    assert recorded(again, (stale,)) == again
    done = recorded(again, (SliceRead(began, 128, 256, 0), SliceRead(began, 256, 300, 1)))
    assert done.pass_end is None and done.last_pass_at == began and done.last_pass_found == 3


def test_net__a_pass_begins_only_when_none_is_under_way_and_the_last_is_old() -> None:
    recent = NetState(last_pass_at="t", last_pass_found=0, last_pass_age=10.0)
    assert begun(recent, 600, 5, "now") == recent
    assert next_pass_in(recent, 600) == 590
    old = NetState(last_pass_at="t", last_pass_found=0, last_pass_age=700.0)
    assert begun(old, 600, 5, "now").pass_began == "now"
    assert next_pass_in(old, 600) == 0
    under_way = begun(NetState(), 600, 5, "then")
    assert begun(under_way, 600, 9, "now") == under_way
    assert next_pass_in(NetState(), 600) == 0  # never: due now


def test_save__the_fresher_front_is_kept() -> None:
    older = ClaimFront(10, (3,), "5:8:")
    newer = ClaimFront(20, (4,), "9:12:")
    assert chosen_front(older, 8, newer) == newer
    assert chosen_front(newer, 12, older) == newer
    assert chosen_front(None, None, ClaimFront()) is None
    assert chosen_front(older, 8, ClaimFront()) == older
