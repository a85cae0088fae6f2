"""The scaling grid's fair baseline: N bare publishers in parallel, their shares of
the bodies, their common span, and the ratios the grid prints."""

from __future__ import annotations

import pytest

from outbox.bench.publishers import parallel_seconds, split_evenly
from outbox.bench.run import ratio, render


def test_split_evenly__consecutive_shares_that_cover_every_body_once() -> None:
    assert split_evenly(80_000, 4) == [
        range(0, 20_000),
        range(20_000, 40_000),
        range(40_000, 60_000),
        range(60_000, 80_000),
    ]
    assert [len(s) for s in split_evenly(10, 4)] == [3, 3, 2, 2]
    assert split_evenly(7, 1) == [range(0, 7)]
    for total, parts in ((1, 4), (3, 4), (1001, 3), (5, 5)):
        shares = split_evenly(total, parts)
        assert [i for s in shares for i in s] == list(range(total)), (total, parts)
        assert all(len(s) > 0 for s in shares)
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
        assert len(shares) == min(total, parts)
    assert split_evenly(0, 2) == []
    with pytest.raises(ValueError):
        split_evenly(10, 0)


def test_parallel_seconds__from_the_first_publish_of_any_to_the_last_confirm_of_all() -> None:
    # The second publisher starts late and the first finishes last: neither span alone.
    assert parallel_seconds([(10.0, 14.5), (10.25, 13.0), (10.1, 14.0)]) == 4.5
    assert parallel_seconds([(2.0, 3.0)]) == 1.0
    with pytest.raises(ValueError):
        parallel_seconds([])


def test_ratio__three_places_and_none_without_a_denominator() -> None:
    assert ratio(16_000, 18_600) == 0.86
    assert ratio(18_600, 18_600) == 1.0
    assert ratio(1, 3) == 0.333
    assert ratio(5, 0) is None


def _report(scaling: list[dict[str, object]]) -> dict[str, object]:
    return {
        "machine": {"cpus": 2, "postgres": "private cluster"},
        "server_version": "15",
        "rows": 80_000,
        "payload_bytes": 1024,
        "repeats": 3,
        "throughput": {
            "bare_median": 18_000,
            "relay_median": 17_000,
            "ratio": 0.944,
            "window": 1000,
        },
        "scaling": scaling,
        "bursts": [],
        "ordering": None,
        "latency": None,  # --no-latency
        "idle": None,
        "memory": [],
        "every_row_arrived": True,
    }


def test_render__a_scaling_row_gives_both_baselines_and_no_latency_when_skipped() -> None:
    row = {
        "relays": 4,
        "batch_size": 1000,
        "msg_per_s": 16_000,
        "runs_msg_per_s": [15_900, 16_000, 16_100],
        "ratio_to_bare": 0.889,
        "parallel_bare_msg_per_s": 18_600,
        "parallel_bare_runs_msg_per_s": [18_500, 18_600, 18_700],
        "ratio_to_parallel_bare": 0.86,
        "parallel_bare_cpu_s_per_10k": 0.2,
        "machine_busy_percent": 95.0,
        "relay_cpu_seconds": 1.5,
        "cpu_s_per_10k": 0.15,
        "backend_cpu_s_per_10k": 0.5,
    }
    text = render(_report([row]))
    assert (
        "| 4 | 1000 | 16,000 | 18,600 | 0.86 | 0.89 | 15,900 / 16,000 / 16,100 "
        "| 18,500 / 18,600 / 18,700 | 95% | 1.5 | 0.65 (0.15 + 0.50 PostgreSQL) | 0.20 |"
    ) in text
    assert "| relays | batch | msg/s | N bare msg/s | ratio to N bare | ratio to 1 bare |" in text
    assert "latency" not in text and "idle" not in text
    assert text.endswith("every row arrived exactly once")
