"""Traces (supervisor/tracing.py, `[tracing]`): a span per call, a child
span per attempt, GenAI attributes, the caller's traceparent honoured; the
SDK never imported without `[tracing]`; and a real daemon exporting over
OTLP/HTTP to a receiver in this test."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from streamfence.config.model import ConfigError, ProviderProfile, parse_config
from streamfence.config.tracing import TracingConfig
from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess
from streamfence.devtools.launcher import DaemonExited
from streamfence.gateway.keys import http_key
from streamfence.protocol.credentials import load_credentials
from streamfence.protocol.errors import ProtocolError
from streamfence.protocol.messages import Submit, parse_request
from streamfence.supervisor.recovery import make_call
from streamfence.supervisor.tracing import CallTracer
from tests.harness import DaemonProcess, free_port, healthy, wait_until
from tests.wires import profile_for, request_for

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


# ---- what a submit and the config may say ---------------------------------------------
def _submit(options: dict[str, Any]) -> dict[str, Any]:
    return {"v": 1, "op": "submit", "ref": "r", "call": {
        "provider": "p", "request": {"model": "m"}, "options": options}}


def test_a_traceparent_option_is_checked() -> None:
    submit = parse_request(_submit({"traceparent": TRACEPARENT}))
    assert isinstance(submit, Submit) and submit.call.options.traceparent == TRACEPARENT
    for bad in ("", "00-xyz", f"ff-{TRACE_ID}-{PARENT_ID}-01", f"00-{'0' * 32}-{PARENT_ID}-01",
                f"00-{TRACE_ID}-{'0' * 16}-01", TRACEPARENT.upper(), TRACEPARENT + "-x"):
        with pytest.raises(ProtocolError) as caught:
            parse_request(_submit({"traceparent": bad}))
        assert "call.options.traceparent" in str(caught.value), bad


def test_the_tracing_table_names_its_problems() -> None:
    cfg = parse_config({"tracing": {"endpoint": "http://127.0.0.1:4318/v1/traces"}}, "f.toml")
    assert cfg.tracing == TracingConfig(endpoint="http://127.0.0.1:4318/v1/traces")
    assert not parse_config({}).tracing.enabled
    with pytest.raises(ConfigError) as caught:
        parse_config({"tracing": {"endpont": "x", "endpoint": "grpc://h:4317",
                                  "timeout_s": 0}}, "f.toml")
    assert str(caught.value) == (
        "f.toml: tracing.endpont: unknown key (did you mean 'endpoint'?); "
        "f.toml: tracing.endpoint: must be an http:// or https:// URL (OTLP/HTTP), got "
        "'grpc://h:4317'; f.toml: tracing.timeout_s: must be in (0, 300] seconds")
    with pytest.raises(ConfigError) as caught:
        parse_config({"tracing": {"endpoint": "https://u:secret@h/v1/traces"}}, "f.toml")
    assert "secret" not in str(caught.value) and "OTEL_EXPORTER_OTLP_TRACES_HEADERS" in str(
        caught.value)


def test_nothing_of_opentelemetry_is_imported_without_tracing() -> None:
    code = ("import sys; import streamfence.supervisor.daemon, streamfence.gateway.app; "
            "bad = sorted(m for m in sys.modules if m.startswith('opentelemetry')); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---- the spans of one call, from its journal rows --------------------------------------
def _rows() -> list[dict[str, Any]]:
    return [{"attempt": 1, "started": 100.5, "ended": 102.0, "worker_pid": 41, "how": "stale",
             "finish_reason": None, "error_class": None, "error_code": None,
             "first_chunk_ms": 12.5, "chunks": 3, "bytes": 30, "deltas": 3, "refused": 7},
            {"attempt": 2, "started": 102.1, "ended": 103.0, "worker_pid": 42, "how": "ended",
             "finish_reason": "stop", "error_class": None, "error_code": None,
             "first_chunk_ms": 9.0, "chunks": 20, "bytes": 200, "deltas": 20}]


def test_a_retried_call_is_one_call_span_with_an_attempt_span_each() -> None:
    exporter = InMemorySpanExporter()
    tracer = CallTracer(TracingConfig(endpoint="http://127.0.0.1:9/v1/traces"), "1.0", exporter)
    profile = ProviderProfile(name="emu", kind="anthropic")
    call = make_call("c1", "alice", "emu", {"emu": profile}, {},
                     {"model": "claude-x", "messages": []}, {"traceparent": TRACEPARENT},
                     "s1", None, 100.0, 2, 2)
    done = {"status": "completed", "attempts": 2, "error": None, "response": {
        "model": "claude-x-1", "finish_reason": "end_turn", "provider_response_id": "msg_1",
        "usage": {"prompt_tokens": 11, "completion_tokens": 22}}}
    tracer.call_done(call, done, 100.0, _rows(), 103.5)
    tracer.close()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"chat claude-x", "attempt 1", "attempt 2"}
    root = spans["chat claude-x"]
    assert root.context is not None and root.parent is not None
    assert (f"{root.context.trace_id:032x}", f"{root.parent.span_id:016x}") == (
        TRACE_ID, PARENT_ID)
    assert (root.start_time, root.end_time) == (100_000_000_000, 103_500_000_000)
    assert dict(root.attributes or {}) == {
        "gen_ai.operation.name": "chat", "gen_ai.system": "anthropic",
        "gen_ai.request.model": "claude-x", "gen_ai.response.model": "claude-x-1",
        "gen_ai.response.id": "msg_1", "gen_ai.response.finish_reasons": ("end_turn",),
        "gen_ai.usage.input_tokens": 11, "gen_ai.usage.output_tokens": 22,
        "streamfence.call_id": "c1", "streamfence.profile": "emu",
        "streamfence.identity": "alice", "streamfence.status": "completed",
        "streamfence.attempts": 2, "streamfence.session_id": "s1"}
    first, second = spans["attempt 1"], spans["attempt 2"]
    for child in (first, second):
        assert child.parent is not None and child.parent.span_id == root.context.span_id
    assert first.status.status_code.name == "ERROR" and second.status.status_code.name == "UNSET"
    assert [(e.name, dict(e.attributes or {}), e.timestamp) for e in first.events] == [
        ("streamfence.fenced", {"streamfence.fence.reason": "stale"}, 102_000_000_000),
        ("streamfence.fence_refusals", {"streamfence.fence.refused_deltas": 7},
         102_000_000_000)]
    assert dict(second.attributes or {})["streamfence.attempt.worker_pid"] == 42


# ---- a real daemon, over OTLP/HTTP ----------------------------------------------------------
class _Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP collector stand-in: keeps every span it is sent."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.spans: list[Any] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1/traces"


class _Handler(BaseHTTPRequestHandler):
    server: _Receiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest.FromString(body)
        with self.server.lock:
            self.server.spans.extend(span for resource in request.resource_spans
                                     for scope in resource.scope_spans for span in scope.spans)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[_Receiver]:
    server = _Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.mark.slow
def test_a_daemon_exports_a_retried_calls_spans_under_the_callers_trace(
        tmp_path: Path, emulator: EmulatorProcess, emu: EmulatorClient,
        receiver: _Receiver) -> None:
    emu.script("traced", [{"fault": "stall", "after": 2, "stall_s": 3.0}])
    port = free_port()
    proc = DaemonProcess(tmp_path / "state", {"emu": profile_for("openai", emulator)},
                         env={"OTEL_BSP_SCHEDULE_DELAY": "100"},
                         tables={"tracing": {"endpoint": receiver.url},
                                 "http": {"listen": f"127.0.0.1:{port}"}})

    def spans() -> list[Any]:
        with receiver.lock:
            return list(receiver.spans)
    try:
        proc.start()
        with proc.client() as client:
            call_id = client.submit("emu", request_for("openai", "traced"), options={
                "stale_timeout_s": 1.0, "on_partial": "restart", "traceparent": TRACEPARENT})
            done = list(client.events(call_id, timeout_s=30.0))[-1]
        assert (done["status"], done["attempts"]) == ("completed", 2), done
        wait_until(lambda: len(spans()) >= 3, 20, "the call's three spans at the OTLP receiver")
        # Over HTTP, the caller's traceparent header: the call joins its trace.
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: healthy(url), 30.0, f"the gateway to answer {url}/healthz")
        http_parent = "1" * 16
        with openai.OpenAI(base_url=url + "/v1", max_retries=0,
                           api_key=http_key(load_credentials(proc.credentials_path))) as sdk:
            sdk.chat.completions.create(
                model="emu-model#http", messages=[{"role": "user", "content": "hi"}],
                extra_headers={"traceparent": f"00-{TRACE_ID}-{http_parent}-01"})
        wait_until(lambda: len(spans()) >= 5, 20, "the HTTP call's spans at the OTLP receiver")
    finally:
        proc.cleanup()
    roots = {s.name: s for s in spans() if s.name.startswith("chat ")}
    assert set(roots) == {"chat emu-model#traced", "chat emu-model#http"}, set(roots)
    http_root = roots["chat emu-model#http"]
    assert (http_root.trace_id.hex(), http_root.parent_span_id.hex()) == (TRACE_ID, http_parent)
    root = roots["chat emu-model#traced"]
    assert (root.trace_id.hex(), root.parent_span_id.hex()) == (TRACE_ID, PARENT_ID)
    children = {s.name: s for s in spans() if s.parent_span_id == root.span_id}
    assert set(children) == {"attempt 1", "attempt 2"}, set(children)
    attrs = {a.key: a.value for a in root.attributes}
    assert attrs["streamfence.call_id"].string_value == call_id
    assert attrs["gen_ai.system"].string_value == "openai"
    usage = done["response"]["usage"]
    assert (attrs["gen_ai.usage.input_tokens"].int_value,
            attrs["gen_ai.usage.output_tokens"].int_value) == (
        usage["prompt_tokens"], usage["completion_tokens"])
    first, second = children["attempt 1"], children["attempt 2"]
    assert [e.name for e in first.events] == ["streamfence.fenced"]
    assert first.events[0].attributes[0].value.string_value == "stale"
    assert first.end_time_unix_nano <= second.start_time_unix_nano
    assert not second.events


@pytest.mark.slow
def test_a_start_without_the_sdk_says_what_to_install(tmp_path: Path) -> None:
    shadow = tmp_path / "shadow" / "opentelemetry"  # a package without the SDK in it
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("")
    proc = DaemonProcess(tmp_path / "state", {}, env={"PYTHONPATH": str(shadow.parent)},
                         tables={"tracing": {"endpoint": "http://127.0.0.1:9/v1/traces"}})
    with pytest.raises(DaemonExited):
        proc.start(ready_timeout=60)
    assert proc.stop() not in (0, None)
    said = [line for line in proc.log_text().splitlines() if "tracing" in line]
    assert len(said) == 1 and "pip install 'streamfence[tracing]'" in said[0], said
    assert "Traceback" not in proc.log_text()
