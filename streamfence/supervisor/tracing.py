"""OpenTelemetry traces of calls (docs/ARCHITECTURE.md, "Traces"): with
`[tracing]` set, a span per call and a child span per attempt, built when
the call ends from what the journal holds of it (its acceptance, each
attempt's start, end and how it ended), with their recorded start and end
times. Nothing runs per delta, nothing is kept per live call, and a call
recovered after a restart is traced like any other.

The call's span joins the caller's trace when the submit carried a W3C
`traceparent` (call option; the gateway takes it from the HTTP header).
Attributes follow the GenAI semantic conventions (`gen_ai.*`) and add
streamfence's own (`streamfence.*`); an attempt that was fenced has a
`streamfence.fenced` event with the reason, at its end.

The opentelemetry SDK is an optional dependency (the `tracing` extra) and
is imported only here, only when `[tracing]` is set (`call_tracer`). Spans
are exported over OTLP/HTTP by the SDK's batch processor, on its own
thread, so an export never blocks the supervisor's loop; `close` flushes.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from streamfence.config.tracing import TracingConfig
from streamfence.supervisor.usage import tokens_of

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from streamfence.supervisor.calls import Call

EXTRA_HINT = "pip install 'streamfence[tracing]'"
# gen_ai.system's values for the profile kinds
_SYSTEMS = {"openai": "openai", "anthropic": "anthropic", "bedrock": "aws.bedrock"}
_NS = 1_000_000_000


def missing_sdk() -> str | None:
    """Why `[tracing]` cannot be honoured here (the SDK or exporter is not
    installed), or None."""
    for module in ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return f"tracing: {module} is not installed ({EXTRA_HINT})"
    return None


class CallTracer:
    """Owns the tracer provider and its exporter; `call_done` emits one call's spans."""

    def __init__(self, config: TracingConfig, version: str,
                 exporter: SpanExporter | None = None) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            exporter = OTLPSpanExporter(endpoint=config.endpoint, timeout=config.timeout_s)
        self._provider = TracerProvider(resource=Resource.create(
            {"service.name": config.service_name, "service.version": version}))
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("streamfence", version)
        self._propagator = TraceContextTextMapPropagator()
        self._kind, self._in = SpanKind.CLIENT, set_span_in_context
        self._status, self._code = Status, StatusCode

    def call_done(self, call: Call, done: Mapping[str, Any], created: float | None,
                  attempts: Sequence[Mapping[str, Any]], now: float) -> None:
        """Emit the spans of `call`, which ended with `done` at `now` (wall
        clock): accepted at `created`, with `attempts` (the journal's rows)."""
        response = done.get("response") or {}
        model = call.model
        parent = None
        if call.spec.options.traceparent:
            parent = self._propagator.extract({"traceparent": call.spec.options.traceparent})
        span = self._tracer.start_span(
            f"chat {model}" if model else "chat", context=parent, kind=self._kind,
            start_time=_ns(created or (attempts[0]["started"] if attempts else now)),
            attributes=_call_attributes(call, done, response, model))
        error = done.get("error")
        if error:
            span.set_status(self._status(self._code.ERROR, f"{error.get('code')}: "
                                                          f"{error.get('message')}"))
        inside = self._in(span)
        for row in attempts:
            ended = row.get("ended") or now
            child = self._tracer.start_span(
                f"attempt {row['attempt']}", context=inside, start_time=_ns(row["started"]),
                attributes=_attempt_attributes(row))
            how = row.get("how")
            if how not in (None, "ended", "rebound"):
                child.add_event("streamfence.fenced", {"streamfence.fence.reason": how},
                                timestamp=_ns(ended))
                child.set_status(self._status(self._code.ERROR, f"fenced: {how}"))
            if row.get("refused"):  # its deltas the fence kept out of the transcript
                child.add_event("streamfence.fence_refusals",
                                {"streamfence.fence.refused_deltas": int(row["refused"])},
                                timestamp=_ns(ended))
            elif row.get("error_code"):
                child.set_status(self._status(self._code.ERROR, str(row["error_code"])))
            child.end(end_time=_ns(ended))
        span.end(end_time=_ns(now))

    def close(self) -> None:
        """Export what is waiting (bounded by the exporter's timeout), then stop."""
        self._provider.shutdown()


def call_tracer(config: TracingConfig, version: str) -> CallTracer | None:
    """The daemon's tracer, or None when `[tracing]` is not set."""
    return CallTracer(config, version) if config.enabled else None


def _ns(seconds: float) -> int:
    return int(seconds * _NS)


def _call_attributes(call: Call, done: Mapping[str, Any], response: Mapping[str, Any],
                     model: str | None) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": "chat", "gen_ai.system": _SYSTEMS.get(call.profile.kind,
                                                                       call.profile.kind),
        "streamfence.call_id": call.call_id, "streamfence.profile": call.profile.name,
        "streamfence.identity": call.owner, "streamfence.status": str(done.get("status")),
        "streamfence.attempts": int(done.get("attempts") or 0)}
    optional: dict[str, Any] = {
        "gen_ai.request.model": model, "gen_ai.response.model": response.get("model"),
        "gen_ai.response.id": response.get("provider_response_id"),
        "streamfence.session_id": call.spec.session_id,
        "streamfence.group": call.spec.provider if call.group is not None else None,
        "error.type": (done.get("error") or {}).get("code")}
    if response.get("finish_reason"):
        attrs["gen_ai.response.finish_reasons"] = [str(response["finish_reason"])]
    if response.get("usage"):  # each worker's, normalized (supervisor/usage.py)
        attrs["gen_ai.usage.input_tokens"], attrs["gen_ai.usage.output_tokens"] = tokens_of(
            response["usage"])
    attrs.update((k, v) for k, v in optional.items() if v is not None)
    return attrs


_ATTEMPT_FIELDS: Mapping[str, Callable[[Any], Any]] = {
    "attempt": int, "how": str, "profile": str, "model": str, "worker_pid": int, "finish_reason": str, "error_class": str,
    "error_code": str, "first_chunk_ms": float, "chunks": int, "bytes": int, "deltas": int,
    "refused": int}


def _attempt_attributes(row: Mapping[str, Any]) -> dict[str, Any]:
    return {f"streamfence.attempt.{key}" if key != "attempt" else "streamfence.attempt":
            cast(row[key]) for key, cast in _ATTEMPT_FIELDS.items() if row.get(key) is not None}
