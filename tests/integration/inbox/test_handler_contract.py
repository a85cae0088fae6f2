"""Issue 18, item 3: the handler contract is enforced after each handler call.

A handler that raises (anything, BaseException included), commits, rolls back,
closes its connection, leaves it aborted, changes its settings, or gets its own
session killed by a server timeout has failed: only its own message counts the
attempt (parked at --max-attempts), every other message is applied exactly once,
and the consumer keeps running.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.servers import Topology
from tests.integration.inbox.support import (
    INBOX,
    consumer,
    effect_bodies,
    parked_bodies,
    publish,
    rows,
    wait_settled,
)


def good(count: int) -> list[tuple[str, bytes]]:
    return [(f"g-{i}", f"ok:g-{i}".encode()) for i in range(count)]


FAILING = [
    "raise",
    "exit",  # SystemExit(3): the consumer exited 3, logging nothing
    "interrupt",  # KeyboardInterrupt: exit 1, no message
    "fatal",  # another BaseException
    "rollback",
    "close",  # 9 reconnects in 40 s, nothing behind it applied
    "swallow",
    "row_factory",  # the next message: "unexpected KeyError: 0"
    "autocommit",
    "read_only",
    "statement_timeout",
    "terminate",
    "own_connect",  # "lost the consumer's PostgreSQL connection", reconnect loop
    "generator",  # acked as applied, with no effect
    "async_generator",  # acked as applied, with no effect
    "coroutine",  # acked as applied, with no effect ("never awaited" warning)
    "raise_huge",  # 100 MB in every log line and row: not parked within 40 s
]


@pytest.mark.parametrize("behaviour", FAILING)
@pytest.mark.parametrize("prefetch", [1, 10])
def test_contract__a_broken_handler_fails_only_its_own_message(
    topology: Topology, consumer_dsn: str, tmp_path: Path, behaviour: str, prefetch: int
) -> None:
    bad = f"{behaviour}:x".encode()
    publish(topology, [(behaviour, bad), *good(4)])
    with consumer(tmp_path, consumer_dsn, topology, max_attempts=2, prefetch=prefetch) as process:
        wait_settled(consumer_dsn, topology, [bad, *(b for _, b in good(4))], 40)
        reconnects = process.output().count("consumer.retry")
    assert parked_bodies(consumer_dsn) == [bad]
    assert sorted(effect_bodies(consumer_dsn)) == sorted(b for _, b in good(4))
    (attempts, error) = rows(consumer_dsn, f"SELECT attempts, error FROM {INBOX}_parked")[0]
    assert attempts == 2 and error
    assert len(error) < 3000, "an attempt's error is one bounded line"
    assert reconnects == 0, "a handler's failure was taken for an outage"


def test_contract__a_handler_outliving_the_idle_timeout_fails_only_its_message(
    topology: Topology, consumer_dsn: str, tmp_path: Path
) -> None:
    """idle_in_transaction_session_timeout ends the session while the handler
    sleeps: "terminating connection due to idle-in-transaction timeout", 8
    reconnects in 45 s before."""
    dsn = consumer_dsn + " options='-c idle_in_transaction_session_timeout=500'"
    publish(topology, [("sleepy", b"sleep:x"), *good(4)])
    with consumer(tmp_path, dsn, topology, max_attempts=2, prefetch=1, env={"HANDLER_SLEEP": "1"}):
        wait_settled(consumer_dsn, topology, [b"sleep:x", *(b for _, b in good(4))], 40)
    assert parked_bodies(consumer_dsn) == [b"sleep:x"]
    assert sorted(effect_bodies(consumer_dsn)) == sorted(b for _, b in good(4))


@pytest.mark.parametrize("behaviour", ["commit", "commit_more"])
def test_contract__a_handler_that_commits_loses_no_other_message(
    topology: Topology, consumer_dsn: str, tmp_path: Path, behaviour: str
) -> None:
    """A handler running COMMIT on message 2 of 6 (default prefetch): 6 ids in the
    inbox and 2 effects before, 4 messages acked without an effect.  Now every id
    in the inbox has its effect, and the other five are applied once."""
    messages = [
        ("c-1", b"ok:c-1"),
        ("c-2", f"{behaviour}:c-2".encode()),
        *[(f"c-{i}", f"ok:c-{i}".encode()) for i in range(3, 7)],
    ]
    publish(topology, messages)
    with consumer(tmp_path, consumer_dsn, topology, max_attempts=2):
        wait_settled(consumer_dsn, topology, [b for _, b in messages], 30)
    applied = effect_bodies(consumer_dsn)
    others = [b for _, b in messages if not b.startswith(b"commit")]
    assert sorted(b for b in applied if b.startswith(b"ok")) == sorted(others)
    ids_with_effect = {r[0] for r in rows(consumer_dsn, "SELECT message_id FROM effects")}
    parked_ids = {r[0] for r in rows(consumer_dsn, f"SELECT message_id FROM {INBOX}_parked")}
    recorded = {r[0] for r in rows(consumer_dsn, f"SELECT message_id FROM {INBOX}")}
    # No id recorded without its effect (a parked message's id is recorded too).
    assert recorded - parked_ids <= ids_with_effect, recorded - parked_ids - ids_with_effect
    # c-2 ended in exactly one place: its (self-committed) effect, or parked.
    assert ("c-2" in ids_with_effect) != ("c-2" in parked_ids)
    assert len(applied) == len(set(applied))


def test_contract__a_session_setting_that_outlives_the_transaction_does_not_stall_the_queue(
    topology: Topology, consumer_dsn: str, tmp_path: Path
) -> None:
    """A handler's plain SET search_path commits with its effect and stays on the
    session: the consumer's own next statement fails on it, and the consumer goes on
    with a new session instead of retrying the same one for ever."""
    first = ("s", b"set_search_path:x")
    publish(topology, [first, *good(4)])
    with consumer(tmp_path, consumer_dsn, topology, prefetch=1):
        wait_settled(consumer_dsn, topology, [first[1], *(b for _, b in good(4))], 40)
    assert sorted(effect_bodies(consumer_dsn)) == sorted([first[1], *(b for _, b in good(4))])
    assert parked_bodies(consumer_dsn) == []


def test_contract__a_handler_that_leaves_a_thread_running_does_not_stop_the_exit(
    tmp_path: Path, consumer_dsn: str, topology: Topology
) -> None:
    """A handler starts a thread that is not a daemon and never ends.  Before, the
    consumer finished on SIGTERM and then hung for ever in Python's exit, waiting for
    it; now it says so in the log (``consumer.threads_left``) and exits 0."""
    publish(topology, [("t-1", b"thread:1")])
    with consumer(tmp_path, consumer_dsn, topology) as process:
        wait_settled(consumer_dsn, topology, [b"thread:1"], timeout=20)
    assert "consumer.threads_left" in process.output()
    assert effect_bodies(consumer_dsn) == [b"thread:1"]
