"""A trace continues from the application's span, through the relay, to the consumer.

The relay carries ``traceparent`` as an ordinary header and starts no span of its
own: with an SDK installed as the global provider, draining a relay records nothing.
"""

from __future__ import annotations

import psycopg
import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import trace

import outbox
from outbox.config import Settings
from outbox.relay.process import Relay
from outbox.tracing import context_from_headers
from tests.fixtures.servers import Topology
from tests.fixtures.tracing import recorded_spans, tracer


def test_tracing__consumer_continues_the_trace_and_the_relay_adds_no_span(
    settings: Settings, topology: Topology
) -> None:
    spans = recorded_spans()
    explicit = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with (
        tracer().start_as_current_span("POST /orders") as request,
        psycopg.connect(settings.dsn) as conn,
    ):
        traced = outbox.enqueue(conn, exchange=topology.exchange, routing_key="a", payload=b"1")
        many = outbox.enqueue_many(
            conn, [outbox.OutgoingMessage(topology.exchange, "b", b"2", {"tenant": "acme"})]
        )
        chosen = outbox.enqueue(
            conn,
            exchange=topology.exchange,
            routing_key="c",
            payload=b"3",
            headers={"traceparent": explicit},
        )
    with psycopg.connect(settings.dsn) as conn:
        untraced = outbox.enqueue(conn, exchange=topology.exchange, routing_key="d", payload=b"4")
    assert [s.name for s in spans.get_finished_spans()] == ["POST /orders"]

    spans.clear()
    relay = Relay(settings)
    relay.start()
    relay.run(drain=True)
    assert relay.stats.messages_published == 4
    assert spans.get_finished_spans() == ()  # no span per message, nor per batch

    headers = {props.message_id: props.headers or {} for _, props, _ in topology.messages()}
    request_context = request.get_span_context()
    expected = f"00-{request_context.trace_id:032x}-{request_context.span_id:016x}-"
    assert headers[str(traced)]["traceparent"].startswith(expected)
    assert headers[str(many[0])]["tenant"] == "acme"
    assert headers[str(many[0])]["traceparent"].startswith(expected)
    assert headers[str(chosen)] == {"traceparent": explicit}
    assert "traceparent" not in headers[str(untraced)]

    for message_id in (str(traced), str(many[0])):
        with tracer().start_as_current_span(
            "order process",
            context=context_from_headers(headers[message_id]),
            kind=trace.SpanKind.CONSUMER,
        ):
            pass
    consumers = spans.get_finished_spans()
    assert len(consumers) == 2
    for span in consumers:
        assert span.parent is not None
        assert span.context.trace_id == request_context.trace_id
        assert span.parent.span_id == request_context.span_id
