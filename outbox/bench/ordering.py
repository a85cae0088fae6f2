"""``outbox bench``, per-key ordering: what keys cost (docs/benchmarks.md#per-key-ordering).

The same backlog (``rows`` rows of ``payload`` bytes, one relay, default settings)
is drained three ways, in rounds so that drifts of a shared machine hit each alike:

- **unordered**: every row's ordering key is NULL (the baseline);
- **1,000 keys**: row *i* has key *i* mod 1,000, so a batch of 1,000 holds one row
  of each key and goes out in one wave; the ratio to unordered is the figure;
- **one hot key**: every row shares one key (fewer rows, see ``HOT_ROWS_SHARE``).
  A batch then holds the key's next rows and publishes them one wave each: every
  message waits for the confirm of the one before it, so the rate is about one
  broker round trip (persisted, confirmed) per message, plus a batch's
  PREPARE / ledger record / COMMIT PREPARED per ``batch_size`` messages.  Its
  baseline, measured in the same rounds, is the bare publisher with a window of one
  message (publish, wait for the confirm, publish the next): the broker's own
  ceiling for one ordered stream of confirmed messages.

Figures are medians of ``repeats`` runs; nothing here asserts on time.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from outbox.bench.harness import Bench, Run

# The hot key drains one confirm round trip per message: fewer rows keep the run short.
HOT_ROWS_SHARE = 0.25
DISTINCT_KEYS = 1000

SHAPES: dict[str, int | None] = {"unordered": None, "1000_keys": DISTINCT_KEYS, "one_hot_key": 1}


def measure_ordering(bench: Bench, repeats: int, echo: Callable[[str], None]) -> dict[str, Any]:
    runs: dict[str, list[Run]] = {shape: [] for shape in SHAPES}
    serial: list[Run] = []
    for i in range(repeats):
        for shape, keys in SHAPES.items():
            share = HOT_ROWS_SHARE if keys == 1 else 1.0
            run = bench.relay(1, keys=keys, rows_share=share)
            runs[shape].append(run)
            echo(f"  ordering: {shape:<12} run {i + 1}: {run.rate:,.0f} msg/s")
        serial.append(bench.bare(window=1, rows_share=HOT_ROWS_SHARE))
        echo(f"  ordering: bare, window 1 run {i + 1}: {serial[-1].rate:,.0f} msg/s")
    medians = {shape: statistics.median(r.rate for r in found) for shape, found in runs.items()}
    unordered = medians["unordered"]
    serial_rate = statistics.median(r.rate for r in serial)
    return {
        "bare_window_1": {
            "rows": serial[0].rows,
            "msg_per_s": round(serial_rate),
            "runs_msg_per_s": [round(r.rate) for r in serial],
            "hot_key_ratio": round(medians["one_hot_key"] / serial_rate, 3)
            if serial_rate
            else None,
        },
        "shapes": [
            {
                "shape": shape,
                "rows": runs[shape][0].rows,
                "msg_per_s": round(medians[shape]),
                "runs_msg_per_s": [round(r.rate) for r in runs[shape]],
                "ratio_to_unordered": round(medians[shape] / unordered, 3) if unordered else None,
                "delivered_min": min(r.delivered for r in runs[shape]),
            }
            for shape in SHAPES
        ],
    }


def render_ordering(report: dict[str, Any], repeats: int) -> list[str]:
    lines = [
        "",
        f"per-key ordering, 1 relay, default settings (medians of {repeats})",
        "",
        "| ordering keys | rows | msg/s | ratio to unordered | runs |",
        "|---|---:|---:|---:|---|",
    ]
    for s in report["shapes"]:
        runs = " / ".join(f"{r:,}" for r in s["runs_msg_per_s"])
        ratio = "" if s["ratio_to_unordered"] is None else f"{s['ratio_to_unordered']:.2f}"
        lines.append(f"| {s['shape']} | {s['rows']:,} | {s['msg_per_s']:,} | {ratio} | {runs} |")
    serial = report["bare_window_1"]
    runs = " / ".join(f"{r:,}" for r in serial["runs_msg_per_s"])
    lines += [
        "",
        f"one hot key against the bare publisher with a window of 1 ({serial['rows']:,} "
        f"messages: {serial['msg_per_s']:,} msg/s, runs {runs}): "
        f"{serial['hot_key_ratio']:.2f}",
    ]
    return lines
