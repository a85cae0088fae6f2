"""The life of the relay and the consumer (``outbox.lifecycle``): the same whether the
command or an embedding application runs it; the start-up heap is frozen."""

from __future__ import annotations

import gc
import logging
import socket
import urllib.request
from collections.abc import Callable, Iterator

import pytest

from outbox import cli, lifecycle, probes
from outbox.config import Settings
from outbox.inbox import process as consumer
from outbox.inbox.stats import ConsumerStats
from outbox.relay import process


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_freeze_startup_heap__puts_what_lives_now_out_of_the_collectors_reach(
    unfrozen: None,
) -> None:
    gc.collect()  # what the test process left as garbage is not "alive"
    alive = len(gc.get_objects())
    lifecycle.freeze_startup_heap()
    assert gc.get_freeze_count() >= alive - 1_000
    young = [[i] for i in range(100)]  # created later: collected as usual
    assert len(gc.get_objects()) < len(young) + 1_000


Call = list[str]


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch, unfrozen: None) -> Call:
    """What the relay's and the consumer's lives do, in order, with no server."""
    seen: Call = []
    monkeypatch.setattr(lifecycle, "freeze_startup_heap", lambda: seen.append("freeze"))
    monkeypatch.setattr(
        lifecycle, "collect_young_less_often", lambda size: seen.append(f"young {size}")
    )
    monkeypatch.setattr(process.Relay, "start", lambda self: seen.append("start"))
    monkeypatch.setattr(process.Relay, "close", lambda self: seen.append("close"))

    def relay_run(self: process.Relay, *, drain: bool = False) -> process.Stats:
        seen.append(f"run drain={drain}")
        return process.Stats(messages_published=3)

    monkeypatch.setattr(process.Relay, "run", relay_run)
    monkeypatch.setattr(consumer.Inbox, "start", lambda self: seen.append("start"))
    monkeypatch.setattr(consumer.Inbox, "close", lambda self: seen.append("close"))

    def inbox_run(self: consumer.Inbox) -> ConsumerStats:
        seen.append("run")
        return ConsumerStats()

    monkeypatch.setattr(consumer.Inbox, "run", inbox_run)
    return seen


@pytest.fixture
def command_logging() -> Iterator[Callable[[], None]]:
    """The command configures the root logger (``events.configure``): what undoes it."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level

    def restore() -> None:
        root.handlers[:], root.level = handlers, level

    yield restore
    restore()


RELAY_LIFE = ["start", "freeze", "young 7", "run drain=True", "close"]
CONSUMER_LIFE = ["start", "freeze", "run", "close"]


def handler(conn: object, message: object) -> None:
    pass


def test_relay__the_command_and_an_embedded_relay_live_the_same_life(
    calls: Call,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    command_logging: Callable[[], None],
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(
            ["relay", "--drain", "--dsn", "postgresql://127.0.0.1:1/none", "--batch-size", "7"]
        )
    assert exited.value.code in (0, None)
    assert calls == RELAY_LIFE
    assert "relay.stopped published=3" in capsys.readouterr().err
    calls.clear()
    command_logging()
    settings = Settings(dsn="postgresql://127.0.0.1:1/none", batch_size=7)
    with caplog.at_level(logging.INFO):
        stats = process.Relay(settings).serve(drain=True)
    assert stats.messages_published == 3
    assert calls == RELAY_LIFE
    assert "relay.stopped published=3" in caplog.text


def test_consumer__the_command_and_an_embedded_consume_live_the_same_life(
    calls: Call,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    command_logging: Callable[[], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(consumer.Inbox, "install_signal_handlers", lambda self: None)
    with pytest.raises(SystemExit) as exited:
        cli.main(["consume", f"{__name__}:handler", "--queue", "q"])
    assert exited.value.code in (0, None)
    assert calls == CONSUMER_LIFE
    assert "consumer.summary handled=0" in capsys.readouterr().err
    calls.clear()
    command_logging()
    with caplog.at_level(logging.INFO):
        consumer.consume(handler, queue="q", install_signal_handlers=False)
    assert calls == CONSUMER_LIFE
    assert "consumer.summary handled=0" in caplog.text


@pytest.mark.parametrize("which", ["relay", "consumer"])
def test_lifecycle__embedded_processes_serve_the_endpoints_the_command_serves(
    calls: Call, which: str
) -> None:
    """/healthz answers while the process runs, from the one ``probes.Endpoints``."""
    answers: list[int] = []
    ports: list[int] = []
    start = probes.Endpoints.start

    def started(self: probes.Endpoints) -> probes.Endpoints:
        ports.append(self.port)
        return start(self)

    def probe() -> None:
        url = f"http://127.0.0.1:{ports[0]}/healthz"
        with urllib.request.urlopen(url, timeout=5) as answer:
            answers.append(answer.status)

    def relay_run(self: process.Relay, *, drain: bool = False) -> process.Stats:
        probe()
        return process.Stats()

    def inbox_run(self: consumer.Inbox) -> ConsumerStats:
        probe()
        return ConsumerStats()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(probes.Endpoints, "start", started)
        patch.setattr(process.Relay, "run", relay_run)
        patch.setattr(consumer.Inbox, "run", inbox_run)
        if which == "relay":
            settings = Settings(dsn="postgresql://127.0.0.1:1/none")
            process.Relay(settings).serve(metrics_port=free_port(), metrics_address="127.0.0.1")
        else:
            consumer.consume(
                handler,
                queue="q",
                install_signal_handlers=False,
                metrics_port=free_port(),
                metrics_address="127.0.0.1",
            )
    assert answers == [200]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_lifecycle__a_port_in_use_is_a_usage_error_before_connecting(calls: Call) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = Settings(dsn="postgresql://127.0.0.1:1/none")
        with pytest.raises(probes.PortUnavailable, match=f"cannot listen on 127.0.0.1:{port}"):
            process.Relay(settings).serve(metrics_port=port, metrics_address="127.0.0.1")
    assert calls == []


@pytest.fixture
def thresholds() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


def test_collect_young_less_often__scales_with_the_batch_and_never_lowers(
    thresholds: None,
) -> None:
    gc.set_threshold(700, 10, 10)
    lifecycle.collect_young_less_often(1000)
    assert gc.get_threshold() == (lifecycle.OBJECTS_PER_ROW * 1000, 10, 10)
    lifecycle.collect_young_less_often(1)
    assert gc.get_threshold() == (lifecycle.OBJECTS_PER_ROW * 1000, 10, 10)
