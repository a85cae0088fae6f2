"""W3C trace context in outbox rows, for applications that trace with OpenTelemetry.

When the application has an active span, every way of enqueueing (``outbox.enqueue``
and friends, the SQLAlchemy and Django helpers) stores the span's ``traceparent`` (and
``tracestate``, if any) in the row's headers. The relay copies headers to the AMQP
message untouched and creates no span of its own, so the consumer continues the
application's trace with ``context_from_headers`` at no cost to the relay's hot path.

OpenTelemetry is optional (``pip install 'outbox-relay[opentelemetry]'``) and this
module never imports it on its own: a span can only be active in a process that has
already imported ``opentelemetry.trace``. Without it, ``with_trace_context`` returns
the headers unchanged after one dictionary lookup.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"


@functools.cache
def _propagator() -> TraceContextTextMapPropagator:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator()


def with_trace_context(headers: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """``headers`` plus the active span's W3C trace context, or ``headers`` unchanged.

    Unchanged when OpenTelemetry was never imported, when no valid span is active, or
    when the caller set ``traceparent`` explicitly (the caller chose the parent).
    W3C trace context is written whatever propagators the application configured:
    it is the format consumers in any language can read.
    """
    if sys.modules.get("opentelemetry.trace") is None:
        return headers
    from opentelemetry import trace

    if not trace.get_current_span().get_span_context().is_valid:
        return headers
    if headers is not None and TRACEPARENT in headers:
        return headers
    carrier: dict[str, str] = {}
    _propagator().inject(carrier)
    return {**carrier, **(headers or {})}


def context_from_headers(headers: Mapping[str, Any] | None) -> Context:
    """The OpenTelemetry context a consumer starts its span in, from a message's headers.

    Requires ``opentelemetry-api``. An empty context (a new trace) when the message
    carries no valid ``traceparent``.

        ctx = outbox.tracing.context_from_headers(properties.headers)
        with tracer.start_as_current_span("order.created process", context=ctx,
                                          kind=trace.SpanKind.CONSUMER):
            ...
    """
    carrier = {}
    for name in (TRACEPARENT, TRACESTATE):
        value = (headers or {}).get(name)
        if isinstance(value, bytes):  # AMQP long strings may arrive undecoded
            value = value.decode("utf-8", "replace")
        if isinstance(value, str):
            carrier[name] = value
    return _propagator().extract(carrier)
