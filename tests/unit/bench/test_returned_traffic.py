"""``outbox bench --consume-returned``: counting a libpq trace (``returned.traffic``)."""

from __future__ import annotations

from outbox.bench.returned import Traffic, traffic

# What libpq's trace (suppressed timestamps, regress mode) shows for a simple
# query, a statement on its own (extended protocol) and a pipeline of three.
TRACE = """\
F	10	Query	 "BEGIN"
B	10	CommandComplete	 "BEGIN"
B	5	ReadyForQuery	 T
F	37	Parse	 "" "INSERT INTO t VALUES ($1)" 1 NNNN
F	21	Bind	 "" "" 1 0 1 1 '0' 1 0
F	6	Describe	 P ""
F	9	Execute	 "" 0
F	4	Sync
B	4	ParseComplete
B	4	BindComplete
B	4	NoData
B	15	CommandComplete	 "INSERT 0 1"
B	5	ReadyForQuery	 T
F	11	Query	 "COMMIT"
B	11	CommandComplete	 "COMMIT"
B	5	ReadyForQuery	 I
F	13	Parse	 "" "BEGIN" 0
F	14	Bind	 "" "" 0 0 1 0
F	9	Execute	 "" 0
F	27	Bind	 "" "_pg3_0" 1 0 1 1 'p' 1 0
F	9	Execute	 "" 0
F	14	Parse	 "" "COMMIT" 0
F	14	Bind	 "" "" 0 0 1 0
F	9	Execute	 "" 0
F	4	Sync
F	4	Flush
B	4	ParseComplete
B	10	CommandComplete	 "BEGIN"
B	15	CommandComplete	 "INSERT 0 1"
B	11	CommandComplete	 "COMMIT"
B	5	ReadyForQuery	 I
"""


def test_traffic__counts_statements_round_trips_and_commits_of_a_trace() -> None:
    assert traffic(TRACE.splitlines(keepends=True)) == Traffic(
        statements=6, round_trips=4, commits=2
    )


def test_traffic__a_rolled_back_commit_and_an_unanswered_message_count_nothing() -> None:
    lines = [
        'F\t11\tQuery\t "COMMIT"\n',
        'B\t13\tCommandComplete\t "ROLLBACK"\n',
        "B\t5\tReadyForQuery\t I\n",
        "F\t4\tTerminate\n",
    ]
    assert traffic(lines) == Traffic(statements=1, round_trips=1, commits=0)
