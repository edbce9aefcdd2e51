"""Traces of every API call with OpenTelemetry, exported over OTLP/HTTP to the collector the
config names: one span for the request, children for the cache lookup, the judge, the budget
reservation and settlement, and the model call.

Each app gets its own TracerProvider (tests build several apps in one process); with tracing off
the tracer is OpenTelemetry's no-op one, so call sites never branch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from appliance import __version__
from appliance.settings import TracingSettings

log = logging.getLogger("appliance.tracing")


class Tracing:
    def __init__(self, settings: TracingSettings, db_path: Path | None = None, synchronous: str = "normal") -> None:
        self.settings = settings
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
        self._provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)))
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


def _clean(attributes: dict[str, Any]) -> dict[str, Any]:
    return {k.replace("__", "."): v for k, v in attributes.items() if v is not None}


def annotate(span: Span, **attributes: Any) -> None:
    span.set_attributes(_clean(attributes))


class RequestTrace:
    """One API call's span and its children. Ended exactly once, by whoever finishes the call:
    the handler, or the stream that outlives it."""

    def __init__(self, tracing: Tracing, name: str, **attributes: Any) -> None:
        self.tracing = tracing
        self.root = tracing.start(name, None, **attributes)
        self.engine: Span | None = None
        self._ended = False

    def annotate(self, **attributes: Any) -> None:
        annotate(self.root, **attributes)

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

    def stamp(self, response: Any) -> Any:
        """The trace id in a response header, so a caller can find its trace."""
        if self.trace_id is not None:
            response.headers["x-trace-id"] = self.trace_id
        return response

    def fail(self, exc: BaseException) -> None:
        status = getattr(exc, "status", None)
        if hasattr(exc, "trace_id") and getattr(exc, "trace_id", None) is None:
            exc.trace_id = self.trace_id  # type: ignore[attr-defined]  # an APIError's response carries it
        self.root.record_exception(exc)
        self.root.set_status(Status(StatusCode.ERROR, str(exc)[:200]))
        self.annotate(http__status_code=status)

    def end(self, **attributes: Any) -> None:
        if self._ended:
            return
        self._ended = True
        if self.engine is not None:
            self.engine.end()
        self.annotate(**attributes)
        self.root.end()
