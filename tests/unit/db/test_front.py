"""Which saved front a new session starts from (``outbox.db.front.resumed``)."""

from __future__ import annotations

import itertools

import pytest

from outbox.db.front import (
    RESCAN_SLICES,
    SLICE_PAGES_MIN,
    ClaimFront,
    Cluster,
    RescanPass,
    SavedFront,
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
