"""Which saved front a new session starts from (``outbox.db.front.resumed``)."""

from __future__ import annotations

import pytest

from outbox.db.front import ClaimFront, Cluster, SavedFront, resumed

HERE = Cluster(system_identifier=7, timeline=2, xmax=1_000)
FRONT = ClaimFront(low_water=500, late=(3, 9), seen="900:950:910")


def test_resumed__a_front_saved_here_is_the_start() -> None:
    assert resumed(SavedFront(FRONT, Cluster(7, 2, 950)), HERE) == FRONT
    assert resumed(SavedFront(FRONT, Cluster(7, 2, 1_000)), HERE) == FRONT


@pytest.mark.parametrize(
    "where",
    [Cluster(8, 2, 950), Cluster(7, 1, 950), Cluster(7, 3, 950), Cluster(7, 2, 1_001)],
    ids=["another_cluster", "an_earlier_timeline", "a_later_timeline", "ahead"],
)
def test_resumed__a_front_from_elsewhere_or_ahead_starts_from_the_bottom(where: Cluster) -> None:
    assert resumed(SavedFront(FRONT, where), HERE) == ClaimFront()


def test_resumed__nothing_saved_starts_from_the_bottom() -> None:
    assert resumed(None, HERE) == ClaimFront()
    assert resumed(SavedFront(ClaimFront(), Cluster(7, 2, 950)), HERE) == ClaimFront()
