"""The relay's memory does not grow with the backlog's payloads (hardening issue, item 4).

Before the byte budget a relay claimed 1,000 rows whatever their size, and held
each payload several times (hex text, decoded copies, frames): 250 rows of 8 MiB
took 6 GiB, and a large backlog got it OOM-killed on the same batch forever.
Here one relay (``outbox relay --drain``, a subprocess with default settings)
drains 40 rows of 8 MiB and one of 64 MiB; its peak RSS is its own ``VmHWM``
(``outbox.bench.memory``).

Measured on this test: 171 MiB with the budget and each payload held once;
427 MiB with the budget but payloads copied (text claim, joined frames: the code
before this test); 492 MiB without the budget (``--batch-max-bytes`` of 1 TiB:
all 41 rows in one batch).  Both fail it.
"""

from __future__ import annotations

from outbox.bench.memory import MIB, Backlog, measure

PEAK_RSS_LIMIT = 256 * MIB


def test_memory__a_backlog_of_large_rows_drains_under_256_mib_every_row_once(
    dsn: str, amqp_url: str
) -> None:
    run = measure(dsn, "outbox", amqp_url, Backlog(((40, 8 * MIB), (1, 64 * MIB))))
    assert run.exactly_once, (run.delivered, run.distinct, run.expected, run.log)
    assert run.stopped["dead_letters"] == 0 and run.stopped["rolled_back"] == 0
    assert 0 < run.peak_rss <= PEAK_RSS_LIMIT, f"peak RSS {run.peak_rss / MIB:.0f} MiB"
