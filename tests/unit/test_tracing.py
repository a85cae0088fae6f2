"""outbox.tracing: the active span's W3C trace context into headers, and back out."""

from __future__ import annotations

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

from outbox.enqueue import OutgoingMessage, row_params
from outbox.tracing import context_from_headers, with_trace_context
from tests.fixtures.tracing import recorded_spans, tracer


def traceparent_of(span: trace.Span) -> str:
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def test_tracing__without_an_active_span_headers_are_returned_unchanged() -> None:
    headers = {"tenant": "acme"}
    assert with_trace_context(headers) is headers
    assert with_trace_context(None) is None


def test_tracing__the_active_span_becomes_the_traceparent_header() -> None:
    recorded_spans()
    headers = {"tenant": "acme"}
    with tracer().start_as_current_span("place order") as span:
        result = with_trace_context(headers)
        from_none = with_trace_context(None)
    assert result == {"tenant": "acme", "traceparent": traceparent_of(span)}
    assert int(traceparent_of(span)[-2:], 16) & TraceFlags.SAMPLED
    assert from_none == {"traceparent": traceparent_of(span)}
    assert headers == {"tenant": "acme"}  # the caller's mapping is not modified


def test_tracing__an_explicit_traceparent_is_never_overwritten() -> None:
    recorded_spans()
    mine = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    headers = {"traceparent": mine}
    with tracer().start_as_current_span("place order"):
        assert with_trace_context(headers) is headers


def test_tracing__tracestate_travels_with_the_traceparent() -> None:
    parent = SpanContext(
        trace_id=0x0AF7651916CD43DD8448EB211C80319C,
        span_id=0xB7AD6B7169203331,
        is_remote=False,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
        trace_state=TraceState([("vendor", "opaque")]),
    )
    with trace.use_span(NonRecordingSpan(parent)):
        headers = with_trace_context({})
    assert headers == {
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "tracestate": "vendor=opaque",
    }


def test_tracing__enqueue_parameters_carry_the_trace_context() -> None:
    recorded_spans()
    with tracer().start_as_current_span("place order") as span:
        params = row_params(OutgoingMessage("orders", "k", b"1", {"tenant": "acme"}))
        bare = row_params(OutgoingMessage("orders", "k", b"1"))
    assert params[4].obj == {"tenant": "acme", "traceparent": traceparent_of(span)}
    assert bare[4].obj == {"traceparent": traceparent_of(span)}
    assert row_params(OutgoingMessage("orders", "k", b"1"))[4] is None  # no span: no headers


@pytest.mark.parametrize("encode", [str, str.encode], ids=["str", "bytes"])
def test_tracing__a_consumer_span_continues_the_producers_trace(encode: object) -> None:
    spans = recorded_spans()
    with tracer().start_as_current_span("place order") as producer:
        headers = dict(with_trace_context({"tenant": "acme"}) or {})
    received = {k: encode(v) for k, v in headers.items()}  # type: ignore[operator]
    with tracer().start_as_current_span(
        "process order", context=context_from_headers(received), kind=trace.SpanKind.CONSUMER
    ):
        pass
    consumer = next(s for s in spans.get_finished_spans() if s.name == "process order")
    assert consumer.parent is not None
    assert consumer.parent.span_id == producer.get_span_context().span_id
    assert consumer.context.trace_id == producer.get_span_context().trace_id


def test_tracing__a_message_without_trace_context_starts_a_new_trace() -> None:
    spans = recorded_spans()
    for headers in (None, {}, {"traceparent": "garbage"}, {"traceparent": 7}):
        with tracer().start_as_current_span("process", context=context_from_headers(headers)):
            pass
    assert [s.parent for s in spans.get_finished_spans()] == [None] * 4
