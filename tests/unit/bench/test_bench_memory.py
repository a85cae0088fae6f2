"""How `outbox bench --memory-backlogs` reads a backlog."""

from __future__ import annotations

import pytest

from outbox.bench.memory import KIB, MIB, Backlog, format_size, parse_backlogs, parse_size


@pytest.mark.parametrize(
    ("text", "size"),
    [("1024", 1024), ("1KiB", KIB), ("64 kib", 64 * KIB), ("8MiB", 8 * MIB), ("2G", 2048 * MIB)],
)
def test_parse_size__binary_units(text: str, size: int) -> None:
    assert parse_size(text) == size


def test_backlog__parts_in_order_and_their_sums() -> None:
    backlog = Backlog.parse("1000x8MiB+1x64MiB")
    assert backlog.parts == ((1000, 8 * MIB), (1, 64 * MIB))
    assert backlog.rows == 1001 and backlog.bytes == 1000 * 8 * MIB + 64 * MIB
    assert backlog.describe() == "1,000 x 8 MiB + 1 x 64 MiB"
    assert [b.rows for b in parse_backlogs("20000x1KiB, 64x1MiB,")] == [20000, 64]
    assert format_size(1536) == "1536 B"


@pytest.mark.parametrize("text", ["8MiB", "0x1KiB", "3x0", "ax1KiB", "3x8 furlongs", ""])
def test_backlog__refuses_what_it_cannot_read(text: str) -> None:
    with pytest.raises(ValueError, match="not a"):
        Backlog.parse(text)
