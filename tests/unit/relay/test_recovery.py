"""When knocking on a lost server ends a backoff wait (``outbox.relay.recovery``)."""

from __future__ import annotations

import random
import socket

import pytest

from outbox.relay import recovery
from outbox.relay.recovery import Address, RecoveryWatch

BROKER: Address = ("broker", 5672)
DATABASE: Address = ("db", 5432)


class Servers:
    """Which addresses accept a knock, and how many knocks each got."""

    def __init__(self, *up: Address) -> None:
        self.up = set(up)
        self.knocks: list[Address] = []

    def knock(self, address: Address, _timeout: float) -> bool:
        self.knocks.append(address)
        return address in self.up


def knock_until(watch: RecoveryWatch, seconds: float) -> float | None:
    """Drive the watch for ``seconds``; when it said the server is back, or None."""
    now = 0.0
    while now <= seconds:
        if watch.back(now):
            return now
        now += 0.05
    return None


def test_a_server_that_comes_back_during_the_wait_ends_it_within_a_knock() -> None:
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    servers = Servers()
    watch = RecoveryWatch([[BROKER]], now=0.0, knock=servers.knock, rng=random.Random(seed))
    assert knock_until(watch, 10.0) is None  # down all along: the backoff is served
    servers.up.add(BROKER)
    back = watch.next_knock
    assert watch.back(back - 0.01) is False  # not between knocks
    assert watch.back(back) is True
    assert servers.knocks.count(BROKER) <= 10 / (recovery.PROBE_INTERVAL / 2) + 2


def test_a_server_that_answers_the_first_knock_never_ends_the_wait() -> None:
    """A flapping connection, a failing write, a proxy accepting for a dead backend:
    the server did not come back during this wait, so the backoff is served in full."""
    servers = Servers(BROKER)
    watch = RecoveryWatch([[BROKER]], now=0.0, knock=servers.knock, rng=random.Random(7))
    assert knock_until(watch, 30.0) is None
    assert servers.knocks  # it knocked, and kept knocking


def test_every_lost_server_must_answer() -> None:
    servers = Servers()
    watch = RecoveryWatch(
        [[BROKER], [DATABASE]], now=0.0, knock=servers.knock, rng=random.Random(3)
    )
    assert knock_until(watch, 2.0) is None
    servers.up.add(BROKER)
    assert knock_until(watch, 5.0) is None  # the database is still down
    servers.up.add(DATABASE)
    assert watch.back(watch.next_knock) is True


def test_any_address_of_a_server_will_do() -> None:
    other: Address = ("broker-2", 5672)
    servers = Servers()
    watch = RecoveryWatch([[BROKER, other]], now=0.0, knock=servers.knock, rng=random.Random(5))
    assert knock_until(watch, 2.0) is None
    servers.up.add(other)
    assert watch.back(watch.next_knock) is True


def test_nothing_lost_or_unknown_address_never_ends_the_wait() -> None:
    servers = Servers()
    assert knock_until(RecoveryWatch([], now=0.0, knock=servers.knock), 5.0) is None
    assert knock_until(RecoveryWatch([[]], now=0.0, knock=servers.knock), 5.0) is None
    assert servers.knocks == []


def test_relays_knock_at_spread_moments() -> None:
    """Many relays failing together must not knock (and come back) together."""
    firsts = {
        round(RecoveryWatch([[BROKER]], now=0.0, rng=random.Random(seed)).next_knock, 3)
        for seed in range(50)
    }
    assert len(firsts) > 40
    assert all(recovery.PROBE_INTERVAL / 4 <= t <= recovery.PROBE_INTERVAL / 2 for t in firsts)


@pytest.mark.parametrize(
    ("dsn", "addresses"),
    [
        ("postgresql://u@db.example:6432/x", [("db.example", 6432)]),
        ("host=a,b port=5433,5434 dbname=x", [("a", 5433), ("b", 5434)]),
        ("host=a,b port=5433", [("a", 5433), ("b", 5433)]),
        ("host=/run/postgresql dbname=x", [("/run/postgresql", 5432)]),
        ("hostaddr=10.0.0.1 host=db port=5432", [("10.0.0.1", 5432)]),
        ("dbname=x", []),  # the host is the environment's: nothing to knock on
        ("host=a,b port=1,2,3", []),
    ],
)
def test_database_addresses(dsn: str, addresses: list[Address]) -> None:
    assert recovery.database_addresses(dsn) == addresses


def test_answers_tells_a_listening_port_from_a_closed_one() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert recovery.answers(("127.0.0.1", port), 1.0) is True
    assert recovery.answers(("127.0.0.1", port), 1.0) is False
