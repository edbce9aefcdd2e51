"""Traces of every API call with OpenTelemetry, exported over OTLP/HTTP to the collector the
config names: one span for the request, children for the cache lookup, the judge, the budget
reservation and settlement, and the model call.

The request's span follows OpenTelemetry's GenAI conventions: named `{operation} {model}` (`chat
smollm2`, `text_completion …`, `embeddings …`), kind SERVER, with the `gen_ai.*` attributes of the
call. A W3C `traceparent` makes it a child of the caller's span where every caller is one tenant
(open mode); with keys it starts a trace of its own that links to the caller's span, since a
trace id is only the caller's word and may be another tenant's. It is the
one span of a request that carries `gen_ai.*`: the spans under it (the engine's, a judge's) use
our own names, so a backend that adds up `gen_ai.usage.*` counts each answer once.

Each app gets its own TracerProvider (tests build several apps in one process); with tracing off
the tracer is OpenTelemetry's no-op one, so call sites never branch.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from appliance import __version__
from appliance.config.settings import TracingSettings

log = logging.getLogger("appliance.server.tracing")

PROVIDER = "appliance"  # gen_ai.provider.name: the caller talks to this server, whatever engine answers
# The W3C trace context only: what a caller sends in `traceparent`/`tracestate`, whatever else is installed.
_PROPAGATOR = TraceContextTextMapPropagator()
# What OpenAI accepts as a caller's own request id: printable ASCII, at most 512 characters.
_CLIENT_REQUEST_ID = re.compile(r"[\x20-\x7e]{1,512}")


class Tracing:
    def __init__(self, settings: TracingSettings, db_path: Path | None = None, synchronous: str = "normal",
                 join_callers: bool = False) -> None:
        """`join_callers`: a caller's `traceparent` joins its trace (callers are one tenant); else links to it."""
        self.settings = settings
        self.join_callers = join_callers
        self._provider: Any = None
        store = settings.store and db_path is not None
        if not settings.enabled and not store:
            self.tracer: trace.Tracer = trace.NoOpTracer()
            return
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        resource = Resource.create({"service.name": settings.service_name, "service.version": __version__})
        ratio = TraceIdRatioBased(settings.sample_ratio)
        # A caller whose trace ours joins, and samples, gets ours recorded; one that does not sample
        # cannot switch ours off: the server's own ratio decides then (and for a linked trace).
        self._provider = TracerProvider(resource=resource, sampler=ParentBased(ratio, remote_parent_not_sampled=ratio))
        # Spans leave in batches from each processor's own thread: the request path never waits on export.
        if store:
            from appliance.store.traces import SqliteSpanExporter

            assert db_path is not None
            exporter = SqliteSpanExporter(db_path, settings.retention_days * 86400, settings.max_spans, synchronous)
            self._provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=min(500, settings.export_interval_ms)))
        if settings.enabled:
            self._provider.add_span_processor(BatchSpanProcessor(
                OTLPSpanExporter(endpoint=settings.otlp_endpoint, timeout=5), schedule_delay_millis=settings.export_interval_ms))
        self.tracer = self._provider.get_tracer("appliance", __version__)

    def start(self, name: str, parent: Span | None = None, **attributes: Any) -> Span:
        """A span that the caller ends (it may outlive the handler, as a stream does)."""
        context = trace.set_span_in_context(parent) if parent is not None else None
        return self.tracer.start_span(name, context=context, attributes=_clean(attributes))

    def start_server(self, name: str, headers: Mapping[str, str] | None, **attributes: Any) -> Span:
        """A request's span: under the caller's span when its headers carry a trace context and
        callers may join; else a trace of its own, the caller's span kept as a link and as
        `appliance.caller.{trace_id,span_id}`, so no caller joins (or is read with) another's trace."""
        context = _PROPAGATOR.extract(headers) if headers is not None else None
        caller = trace.get_current_span(context).get_span_context() if context is not None else None
        if caller is None or not caller.is_valid or self.join_callers:
            return self.tracer.start_span(name, context=context, kind=SpanKind.SERVER, attributes=_clean(attributes))
        return self.tracer.start_span(name, context=Context(), kind=SpanKind.SERVER, links=[Link(caller)], attributes=_clean(
            {**attributes, "caller__trace_id": format(caller.trace_id, "032x"), "caller__span_id": format(caller.span_id, "016x")}))

    @contextmanager
    def span(self, name: str, parent: Span | None, **attributes: Any) -> Iterator[Span]:
        span = self.start(name, parent, **attributes)
        try:
            yield span
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, str(exc)[:200]))
            raise
        finally:
            span.end()

    def close(self) -> None:
        """Exports what is still buffered (blocking: call it off the event loop)."""
        if self._provider is not None:
            self._provider.shutdown()


# Names of the standard conventions other than GenAI's that spans here use.
_STANDARD = {"http__status_code": "http.response.status_code", "error__type": "error.type"}


def attribute_name(keyword: str) -> str:
    """The one mapping from the keyword names call sites use to attribute names: `__` is a dot;
    `gen_ai__…` and the few standard names are OpenTelemetry's; everything else is ours, under
    `appliance.` (`cache__result` is `appliance.cache.result`)."""
    if keyword in _STANDARD:
        return _STANDARD[keyword]
    name = keyword.replace("__", ".")
    return name if keyword.startswith("gen_ai__") else f"appliance.{name}"


def _clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    return {attribute_name(k): v for k, v in attributes.items() if v is not None}


def client_request_id(headers: Mapping[str, str]) -> str | None:
    """The caller's own id for its request (`X-Client-Request-Id`, or `X-Request-Id`), if well formed."""
    for name in ("x-client-request-id", "x-request-id"):
        value = headers.get(name)
        if value is not None and _CLIENT_REQUEST_ID.fullmatch(value):
            return value
    return None


# A span records the body before it is checked: what a caller wrote is cut to a sane size there.
_MAX_TEXT, _MAX_ITEMS = 256, 8


def requested_model(body: Any) -> str:
    return str(body.model)[:_MAX_TEXT]


def request_attributes(body: Any) -> dict[str, Any]:
    """`gen_ai.request.*` from an OpenAI request body (chat, completion or embeddings): what the
    caller asked for, read as it was sent (not yet checked, so long text is cut)."""
    stop = getattr(body, "stop", None)
    stop = [stop] if isinstance(stop, str) else stop
    response_format = getattr(body, "response_format", None)
    n = getattr(body, "n", 1)
    return {
        "gen_ai__request__model": requested_model(body),
        "gen_ai__request__max_tokens": getattr(body, "max_completion_tokens", None) or getattr(body, "max_tokens", None),
        "gen_ai__request__temperature": getattr(body, "temperature", None),
        "gen_ai__request__top_p": getattr(body, "top_p", None),
        "gen_ai__request__seed": getattr(body, "seed", None),
        "gen_ai__request__frequency_penalty": getattr(body, "frequency_penalty", None),
        "gen_ai__request__presence_penalty": getattr(body, "presence_penalty", None),
        "gen_ai__request__stop_sequences": [str(x)[:_MAX_TEXT] for x in stop[:_MAX_ITEMS]] if stop else None,
        "gen_ai__request__choice__count": n if n != 1 else None,
        "gen_ai__output__type": None if response_format is None else ("text" if response_format.type == "text" else "json"),
    }


def annotate(span: Span, **attributes: Any) -> None:
    span.set_attributes(_clean(attributes))


class RequestTrace:
    """One API call's span and its children. Ended exactly once, by whoever finishes the call:
    the handler, or the stream that outlives it."""

    def __init__(self, tracing: Tracing, operation: str, headers: Mapping[str, str] | None = None, **attributes: Any) -> None:
        """`operation` is GenAI's name for the call (`chat`, `text_completion`, `embeddings`);
        `headers`, the request's: a `traceparent` there makes this trace part of the caller's."""
        self.tracing = tracing
        self.operation = operation
        client_id = client_request_id(headers) if headers is not None else None
        self.root = tracing.start_server(operation, headers, gen_ai__operation__name=operation, gen_ai__provider__name=PROVIDER,
                                         client_request_id=client_id, **attributes)
        self.engine: Span | None = None
        self._ended = False

    def annotate(self, **attributes: Any) -> None:
        annotate(self.root, **attributes)

    def requested(self, body: Any) -> None:
        """The body is read: the span takes the model's name (`chat smollm2`) and what was asked."""
        self.root.update_name(f"{self.operation} {requested_model(body)}")
        self.annotate(**request_attributes(body))

    def answered(self, response_id: str, model: str, finish_reasons: list[str] | None, input_tokens: int | None = None,
                 output_tokens: int | None = None) -> None:
        """What the caller got back: the response's id, the model that answered, why each choice ended, the usage."""
        self.annotate(gen_ai__response__id=response_id, gen_ai__response__model=model, gen_ai__response__finish_reasons=finish_reasons,
                      gen_ai__usage__input_tokens=input_tokens, gen_ai__usage__output_tokens=output_tokens)

    def child(self, name: str, **attributes: Any):  # type: ignore[no-untyped-def]
        return self.tracing.span(name, self.root, **attributes)

    def start_engine(self, parent: Span | None = None, **attributes: Any) -> None:
        """The model call's span, under `parent` (a routed request's attempt) or the request's root;
        a routed request's next attempt ends the previous one."""
        if self.engine is not None:
            self.engine.end()
        self.engine = self.tracing.start("engine.generate", parent or self.root, **attributes)

    @property
    def trace_id(self) -> str | None:
        context = self.root.get_span_context()
        return format(context.trace_id, "032x") if context.is_valid else None

    def fail(self, exc: BaseException) -> None:
        """The call failed before its response began: the error on the span, and the trace ends."""
        status = getattr(exc, "status", None)
        if hasattr(exc, "trace_id") and getattr(exc, "trace_id", None) is None:
            exc.trace_id = self.trace_id  # type: ignore[attr-defined]  # an APIError's response carries it
        self.root.record_exception(exc)
        self.root.set_status(Status(StatusCode.ERROR, str(exc)[:200]))
        # error.type: the API error's code (or type), else the exception's class; low-cardinality either way.
        kind = getattr(exc, "code", None) or getattr(exc, "type", None)
        self.annotate(http__status_code=status, error__type=kind if isinstance(kind, str) else type(exc).__name__)
        self.end()

    def end(self, **attributes: Any) -> None:
        if self._ended:
            return
        self._ended = True
        if self.engine is not None:
            self.engine.end()
        self.annotate(**attributes)
        self.root.end()
