"""Failing over across the nodes of a RabbitMQ cluster (pure decisions).

``--amqp-url`` may name several nodes of one cluster, separated by ``;``.  Every
connection (the relay's publisher, the resolver's ledger reads) tries them in
turn and keeps the first that answers.  Two decisions follow, both pure:

- ``rotation``: the order in which to try the nodes.  The first connection goes
  to the first URL (the operator's preference, and where the ledger stream is
  first declared).  After a connection is lost, the next try starts with the
  node *after* the one that failed: a dead node that drops packets instead of
  refusing them would otherwise cost a whole connect timeout first, every time.
- ``reconnect_delay``: how long the relay waits before trying again.  With one
  node it is the plain exponential backoff, as ever.  With several, a lost node
  means another one may answer at once, so the first try is immediate; when a
  whole round failed (or the failure was something else: a nack, a ledger that
  takes no records yet) the backoff still grows, but is capped at
  ``ROUND_DELAY_MAX`` so the relay is publishing again within a second of a node
  answering (the cap, then connecting, probing the ledger and one batch: first
  commits 0.33-0.51 s after the node answered, ``test_rabbitmq_cluster.py``).  A round costs a TCP
  handshake per node: cheap enough to repeat twice a second for as long as an
  outage lasts.

The backoff is reset by the relay after a batch is committed (or there is nothing to do).
"""

from __future__ import annotations

import random

from outbox import backoff

# Longest pause between two rounds over every node when several are configured.
ROUND_DELAY_MAX = 0.5


def rotation(nodes: int, *, after: int | None) -> list[int]:
    """Indexes of ``nodes`` nodes in the order to try them: from the one after
    ``after`` (the node whose connection failed), or from the first."""
    if nodes < 1:
        raise ValueError("there must be at least one node")
    start = 0 if after is None else (after + 1) % nodes
    return [(start + step) % nodes for step in range(nodes)]


def reconnect_delay(
    attempt: int,
    *,
    nodes: int,
    node_lost: bool,
    initial: float,
    maximum: float,
    rng: random.Random | None = None,
) -> float:
    """Seconds to wait before retrying after ``attempt`` failures in a row (0: the first).

    ``node_lost``: the failure took the broker connection with it (the next round
    starts at another node).  With one node this is ``backoff.delay`` unchanged.
    """
    if nodes <= 1:
        return backoff.delay(attempt, initial=initial, maximum=maximum, rng=rng)
    if attempt < 0:
        raise ValueError("attempt must be >= 0")
    if node_lost and attempt == 0:
        return 0.0
    # Only the first failure of a series is retried at once: a connection that
    # opens and drops again at once must not become a busy loop.
    return backoff.delay(
        max(attempt - 1, 0), initial=initial, maximum=min(maximum, ROUND_DELAY_MAX), rng=rng
    )
