"""``outbox bench --fleet``'s pure parts: the runs asked for, the cluster's sizing,
a process's own sessions (its sockets' local ports)."""

from __future__ import annotations

import os
import socket

import pytest

from outbox.bench.fleet import RUNS, parse_runs, relay_ports, sizing


def test_parse_runs__in_the_bench_order_whatever_the_order_given() -> None:
    assert parse_runs("change, baseline,one") == ("baseline", "one", "change")
    assert parse_runs(",".join(RUNS)) == RUNS


@pytest.mark.parametrize("text", ["", "one,nap", " , "])
def test_parse_runs__unknown_or_none_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="choose from baseline"):
        parse_runs(text)


def test_sizing__two_relays_four_sessions_each_per_database_and_the_writers() -> None:
    size = sizing(50)
    assert size.max_connections == 2 * 50 * 4 + 50 + 40
    assert size.max_prepared_transactions == 2 * 50 * 2 + 8
    assert sizing(3).max_prepared_transactions == 64  # the private cluster's least


def test_relay_ports__are_the_local_ports_of_the_process_sockets() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        try:
            ports = relay_ports(os.getpid())
            assert client.getsockname()[1] in ports
        finally:
            client.close()
    assert relay_ports(2**22 + 1) == set()  # no such process
