"""Ending a reconnect backoff early once a server that was down answers again.

The relay's backoff (``outbox.backoff``) grows with every failure in a row, up to
``--backoff-max`` (30 s by default), and only a committed batch (or nothing to do)
brings it back to its start.  Across a long outage it therefore reaches its ceiling,
and the relay went on sleeping up to 30 s after the server was back (a soak run:
broker down 22 s, then a PostgreSQL restart, 40 s without a message published).

While it waits, the relay now knocks on the servers whose session it lost: a bare TCP
connect (no handshake, no authentication, no backend) every ``PROBE_INTERVAL`` or so,
jittered.  A server that refused (or did not answer) one knock and then accepts
one has come back: the wait ends there and the relay reconnects at once.  Three
things keep what the backoff promises:

- a server that accepted the first knock of a wait has not come back during it
  (it was there all along: the failure was something else, e.g. a connection cut at
  every COMMIT PREPARED, a proxy that accepts while its backend is down): that wait
  is served in full, so a flapping server or a failing write is never hammered;
- a knock costs the server nothing while it is down (the kernel refuses it) and one
  accept once it is back;
- relays knock at random moments of each interval, so many relays waiting out one
  outage come back spread over ``PROBE_INTERVAL``, not all at once.
"""

from __future__ import annotations

import contextlib
import random
import socket
from collections.abc import Callable, Sequence

import psycopg

# Seconds between two knocks on a lost server during a backoff wait (jittered: each
# pause is in [PROBE_INTERVAL/2, PROBE_INTERVAL]).
PROBE_INTERVAL = 1.0

# A (host, port) of a TCP server, or (directory, port) of PostgreSQL's Unix socket.
Address = tuple[str, int]


def database_addresses(dsn: str) -> list[Address]:
    """Where ``dsn`` connects (every host of a multi-host DSN); [] when not known
    (a DSN that leaves the host to the environment): then nothing is knocked on."""
    try:
        info = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return []
    hosts = str(info.get("hostaddr") or info.get("host") or "").split(",")
    ports = str(info.get("port") or "5432").split(",")
    if hosts == [""]:
        return []
    if len(ports) == 1:
        ports = ports * len(hosts)
    try:
        return [(h, int(p or 5432)) for h, p in zip(hosts, ports, strict=True)]
    except ValueError:
        return []


def answers(address: Address, timeout: float) -> bool:
    """True if ``address`` accepts a connection within ``timeout`` (closed at once)."""
    host, port = address
    try:
        if host.startswith("/"):  # PostgreSQL's Unix socket directory
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix:
                unix.settimeout(timeout)
                unix.connect(f"{host}/.s.PGSQL.{port}")
        else:
            socket.create_connection((host, port), timeout=timeout).close()
    except OSError:
        return False
    return True


class RecoveryWatch:
    """Knocks on lost servers during one backoff wait; ``back()`` once one that
    refused a knock accepts one (pure but for ``knock``, which a test may replace).
    """

    def __init__(
        self,
        addresses: Sequence[Sequence[Address]],
        *,
        now: float,
        knock: Callable[[Address, float], bool] = answers,
        rng: random.Random | None = None,
    ) -> None:
        """``addresses``: for each lost server, where it may answer (any of them)."""
        self._servers = [list(server) for server in addresses if server]
        self._knock = knock
        self._rng = rng if rng is not None else random.Random()
        self._refused = [False] * len(self._servers)
        # The first knock at a random moment too: relays that failed together
        # must not knock together.
        self._next = now + self._pause() / 2

    def _pause(self) -> float:
        return PROBE_INTERVAL / 2 + self._rng.random() * PROBE_INTERVAL / 2

    @property
    def next_knock(self) -> float:
        return self._next

    def back(self, now: float) -> bool:
        """Knock if it is time; True once every lost server answers and one of them
        refused a knock of this wait before (it came back while we waited)."""
        if not self._servers or now < self._next:
            return False
        self._next = now + self._pause()
        answering = []
        for index, server in enumerate(self._servers):
            up = False
            with contextlib.suppress(OSError):
                up = any(self._knock(address, PROBE_INTERVAL / 2) for address in server)
            if not up:
                self._refused[index] = True
            answering.append(up)
        return all(answering) and any(self._refused)
