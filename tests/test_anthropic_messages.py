"""workers/anthropic_messages.py: the event assembler on dicts, then
stream_messages / complete_messages / ADAPTER driven by the real anthropic SDK
against the emulator's Anthropic wire (a real HTTP server in a subprocess)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import anthropic
import httpx2
import pytest

from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess
from streamfence.protocol.internal.outcome import AttemptDiag, AttemptOutcome
from streamfence.protocol.internal.workers import AttemptSettings
from streamfence.workers.anthropic_messages import (
    ADAPTER,
    MessagesStreamAssembler,
    complete_messages,
    stream_messages,
)
from streamfence.workers.errors import MalformedStreamError
from streamfence.workers.output import RecordingOutput

REQUEST: dict[str, Any] = {"max_tokens": 512, "messages": [{"role": "user", "content": "hi"}]}


def code_of(final: AttemptOutcome) -> tuple[str, str]:
    assert final.ok is False and final.error is not None
    return final.error.error_class, final.error.code


# ---- event builders ----------------------------------------------------------

def start(usage: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    return ("message_start", {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-t", "content": [],
        "stop_reason": None, "usage": usage or {"input_tokens": 10, "output_tokens": 1}}})


def block(index: int, kind: str = "text", **extra: Any) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"type": kind, **extra}
    return ("content_block_start", {"type": "content_block_start", "index": index,
                                    "content_block": body})


def tool(index: int, name: str = "f", id: str = "toolu_1") -> tuple[str, dict[str, Any]]:
    return block(index, "tool_use", id=id, name=name, input={})


def delta(index: int, kind: str, value: str) -> tuple[str, dict[str, Any]]:
    field_name = {"text_delta": "text", "thinking_delta": "thinking",
                  "input_json_delta": "partial_json", "signature_delta": "signature"}[kind]
    return ("content_block_delta", {"type": "content_block_delta", "index": index,
                                    "delta": {"type": kind, field_name: value}})


def stop(index: int) -> tuple[str, dict[str, Any]]:
    return ("content_block_stop", {"type": "content_block_stop", "index": index})


def mdelta(reason: str | None, output_tokens: int = 5, **details: Any) -> tuple[str, dict[str, Any]]:
    d: dict[str, Any] = {"stop_reason": reason, "stop_sequence": None}
    if details:
        d["stop_details"] = {"type": "refusal", **details}
    return ("message_delta", {"type": "message_delta", "delta": d,
                              "usage": {"output_tokens": output_tokens}})


END = ("message_stop", {"type": "message_stop"})


def text_msg(*pieces: str, reason: str | None = "end_turn") -> list[tuple[str, dict[str, Any]]]:
    return [start(), block(0), *(delta(0, "text_delta", p) for p in pieces), stop(0),
            mdelta(reason), END]


def frag(index: int, args: str, id: str | None = None, name: str | None = None) -> tuple[str, Any]:
    return ("tool_call", {"index": index, "id": id, "name": name, "arguments": args})


def run(events: list[tuple[str, dict[str, Any]]]) -> tuple[RecordingOutput, AttemptOutcome]:
    out = RecordingOutput()
    asm = MessagesStreamAssembler(out)
    for event_type, data in events:
        asm.feed(event_type, data)
    return out, asm.finish()


# ---- the assembler, table-driven -------------------------------------------------

@dataclass
class Case:
    events: list[tuple[str, dict[str, Any]]]
    deltas: list[tuple[str, Any]] | None = None
    final: dict[str, Any] = field(default_factory=dict)
    error: tuple[str, str] | None = None
    tool_calls: list[dict[str, Any]] | None = None


CASES: dict[str, Case] = {
    "text_end_turn": Case(
        text_msg("Hel", "lo"), deltas=[("text", "Hel"), ("text", "lo")],
        final={"finish_reason": "stop", "model": "claude-t", "provider_response_id": "msg_1",
               "usage": {"input_tokens": 10, "output_tokens": 5, "prompt_tokens": 10,
                         "completion_tokens": 5, "total_tokens": 15},
               "dropped_tool_names": [], "dropped_tool_indexes": [], "diag": AttemptDiag()}),
    "thinking_is_reasoning_signature_is_nothing": Case(
        [start(), block(0, "thinking", thinking="", signature=""),
         delta(0, "thinking_delta", "hmm "), delta(0, "thinking_delta", "ok"),
         delta(0, "signature_delta", "c2ln"), stop(0), block(1), delta(1, "text_delta", "Hi"),
         stop(1), mdelta("end_turn"), END],
        deltas=[("reasoning", "hmm "), ("reasoning", "ok"), ("text", "Hi")]),
    "tool_across_many_deltas": Case(
        [start(), block(0), delta(0, "text_delta", "Looking."), stop(0), tool(1, "search"),
         *(delta(1, "input_json_delta", p) for p in ['{"q"', ': "', "cat", 's"', "}"]), stop(1),
         mdelta("tool_use"), END],
        deltas=[("text", "Looking."), frag(0, "", "toolu_1", "search"), frag(0, '{"q"'),
                frag(0, ': "'), frag(0, "cat"), frag(0, 's"'), frag(0, "}")],
        final={"finish_reason": "tool_calls"},
        tool_calls=[{"id": "toolu_1", "name": "search", "arguments": '{"q": "cats"}'}]),
    "block_indexes_become_slots": Case(
        [start(), tool(2, "a", "t_a"), delta(2, "input_json_delta", "{}"), stop(2),
         tool(5, "b", "t_b"), delta(5, "input_json_delta", '{"x":1}'), stop(5),
         mdelta("tool_use"), END],
        tool_calls=[{"id": "t_a", "name": "a", "arguments": "{}"},
                    {"id": "t_b", "name": "b", "arguments": '{"x":1}'}]),
    "tool_without_input_gets_empty_object": Case(
        [start(), tool(0, "now"), delta(0, "input_json_delta", ""), stop(0), mdelta("tool_use"), END],
        deltas=[frag(0, "", "toolu_1", "now"), frag(0, "{}")],
        tool_calls=[{"id": "toolu_1", "name": "now", "arguments": "{}"}]),
    "whole_input_in_block_start": Case(
        [start(), block(0, "tool_use", id="t", name="f", input={"k": 1}), stop(0),
         mdelta("tool_use"), END],
        deltas=[frag(0, '{"k":1}', "t", "f")]),
    "no_message_stop_after_text": Case(
        [start(), block(0), delta(0, "text_delta", "partial")], deltas=[("text", "partial")],
        error=("transient", "no_finish_reason"), final={"finish_reason": None}),
    "stop_reason_without_message_stop_is_incomplete": Case(
        [start(), block(0), delta(0, "text_delta", "x"), stop(0), mdelta("end_turn")],
        error=("transient", "no_finish_reason"), final={"finish_reason": "stop"}),
    "drop_mid_tool_call": Case(
        [start(), block(0), delta(0, "text_delta", "Let me look."), stop(0), tool(1, "search"),
         delta(1, "input_json_delta", '{"q": "ca')],
        error=("transient", "no_finish_reason"),
        final={"dropped_tool_names": ["search"], "dropped_tool_indexes": [0]}),
    "message_stop_without_stop_reason_drops_tool_use": Case(
        [start(), tool(0, "f"), delta(0, "input_json_delta", "{}"), stop(0), END],
        error=("transient", "no_finish_reason"),
        final={"dropped_tool_names": ["f"], "dropped_tool_indexes": [0]}),
    "message_stop_without_stop_reason_text_is_stop": Case(
        [start(), block(0), delta(0, "text_delta", "x"), stop(0), END],
        final={"finish_reason": "stop"}),
    "empty_stream": Case([], error=("transient", "empty_stream"), final={"usage": None}),
    "message_start_only": Case([start()], error=("transient", "empty_stream")),
    "empty_message_with_stop_reason_is_fine": Case(
        [start(), mdelta("end_turn"), END], deltas=[], final={"finish_reason": "stop"}),
    "max_tokens_cuts_tool_arguments": Case(
        [start(), tool(0, "ok_tool", "a"), delta(0, "input_json_delta", "{}"), stop(0),
         tool(1, "cut_tool", "b"), delta(1, "input_json_delta", '{"path": "/tm'), stop(1),
         mdelta("max_tokens"), END],
        final={"finish_reason": "length", "dropped_tool_names": ["cut_tool"],
               "dropped_tool_indexes": [1]}),
    "tool_block_never_stopped_is_dropped": Case(
        [start(), tool(0, "f"), delta(0, "input_json_delta", "{}"), mdelta("tool_use"), END],
        final={"finish_reason": "length", "dropped_tool_names": ["f"]}),
    "arguments_must_be_an_object": Case(
        [start(), tool(0, "f"), delta(0, "input_json_delta", "[1]"), stop(0), mdelta("tool_use"), END],
        final={"finish_reason": "length", "dropped_tool_indexes": [0]}),
    "refusal_is_content_filter_and_runs_no_tool": Case(
        [start(), block(0), delta(0, "text_delta", "Sure"), stop(0), tool(1, "f"),
         delta(1, "input_json_delta", "{}"), stop(1),
         mdelta("refusal", category="cyber", explanation="Not this."), END],
        deltas=[("text", "Sure"), frag(0, "", "toolu_1", "f"), frag(0, "{}"), ("refusal", "Not this.")],
        final={"finish_reason": "content_filter", "dropped_tool_names": ["f"]}),
    "stop_sequence_is_stop": Case(text_msg("x", reason="stop_sequence"), final={"finish_reason": "stop"}),
    "context_window_is_length": Case(
        text_msg("x", reason="model_context_window_exceeded"), final={"finish_reason": "length"}),
    "unknown_stop_reason_passes": Case(text_msg("x", reason="pause_turn"),
                                       final={"finish_reason": "pause_turn"}),
    "usage_with_cache_fields": Case(
        [start({"input_tokens": 3, "cache_creation_input_tokens": 100, "cache_read_input_tokens": 50,
                "output_tokens": 1}), block(0), delta(0, "text_delta", "x"), stop(0),
         mdelta("end_turn", output_tokens=9), END],
        final={"usage": {"input_tokens": 3, "cache_creation_input_tokens": 100,
                         "cache_read_input_tokens": 50, "output_tokens": 9, "prompt_tokens": 153,
                         "completion_tokens": 9, "total_tokens": 162}}),
    "pings_and_unknown_events_are_ignored": Case(
        [start(), ("ping", {"type": "ping"}), ("brand_new_event", {"type": "brand_new_event"}),
         block(0), ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                            "delta": {"type": "citations_delta", "citation": {}}}),
         delta(0, "text_delta", "x"), stop(0), mdelta("end_turn"), END],
        deltas=[("text", "x")]),
    "overloaded_error_event_is_transient": Case(
        [start(), block(0), delta(0, "text_delta", "x"),
         ("error", {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
         delta(0, "text_delta", "ignored")],
        deltas=[("text", "x")], error=("transient", "provider_error")),
    "api_error_event_is_transient": Case(
        [("error", {"type": "error", "error": {"type": "api_error", "message": "Internal"}})],
        error=("transient", "provider_error")),
    "invalid_request_event_is_final": Case(
        [("error", {"type": "error", "error": {"type": "invalid_request_error", "message": "bad"}})],
        error=("final", "provider_error")),
    "prompt_too_long_event_is_context_overflow": Case(
        [("error", {"type": "error", "error": {"type": "invalid_request_error",
                                               "message": "prompt is too long: 210000 tokens > 200000 maximum"}})],
        error=("context_overflow", "context_overflow")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_assembler(name: str) -> None:
    case = CASES[name]
    out, final = run(case.events)
    if case.deltas is not None:
        assert out.deltas == case.deltas
    for key, value in case.final.items():
        got = getattr(final, key)
        assert (list(got) if isinstance(got, tuple) else got) == value, key
    if case.error is None:
        assert final.error is None and final.ok is True
    else:
        assert code_of(final) == case.error, final.error
    if case.tool_calls is not None:
        assert out.tool_calls() == case.tool_calls


@pytest.mark.parametrize("event", [
    ("content_block_delta", {"index": 0, "delta": "text"}),
    ("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": 3}}),
    ("content_block_delta", {"index": 7, "delta": {"type": "input_json_delta", "partial_json": "{"}}),
    ("content_block_start", {"index": 0, "content_block": {"type": "tool_use", "id": "t"}}),
    ("message_start", {"message": {"usage": [1]}}),
])
def test_bad_event_shape_is_malformed(event: tuple[str, dict[str, Any]]) -> None:
    with pytest.raises(MalformedStreamError):
        MessagesStreamAssembler(RecordingOutput()).feed(*event)


def test_input_after_block_stop_is_out_of_order() -> None:
    asm = MessagesStreamAssembler(RecordingOutput())
    for event in (start(), tool(0), stop(0)):
        asm.feed(*event)
    with pytest.raises(MalformedStreamError, match="unexpected event order"):
        asm.feed(*delta(0, "input_json_delta", "{}"))


def test_output_errors_are_not_mistaken_for_malformed_events() -> None:
    class Broken(RecordingOutput):
        def delta(self, kind: str, data: Any) -> None:
            raise KeyError("sink bug")

    with pytest.raises(KeyError, match="sink bug"):
        MessagesStreamAssembler(Broken()).feed(*delta(0, "text_delta", "x"))


def test_pings_only_is_empty_sse_frames() -> None:
    asm = MessagesStreamAssembler(RecordingOutput())
    asm.keepalives = 4
    assert code_of(asm.finish()) == ("transient", "empty_sse_frames")


# ---- over HTTP: the emulator and the real SDK --------------------------------------

@pytest.fixture
def client(emulator: EmulatorProcess) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=emulator.base_url, api_key="test-key", max_retries=0,
                             timeout=anthropic.Timeout(10.0, read=5.0)) as c:
        yield c


def req(key: str, **extra: Any) -> dict[str, Any]:
    return {**REQUEST, "model": f"claude-emu#{key}", **extra}


def only(emu: EmulatorClient, key: str) -> dict[str, Any]:
    records = emu.log(key)
    assert len(records) == 1, records
    return records[0]


def test_stream_tool_call_and_thinking(emu: EmulatorClient, client: anthropic.Anthropic) -> None:
    emu.script("tool", [{"reasoning": True, "text": "Checking.", "chunks": 25,
                         "tool_call": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 3}}}])
    out = RecordingOutput()
    final = stream_messages(client, req("tool"), out)
    record = only(emu, "tool")
    assert final.ok and final.finish_reason == "tool_calls" and final.error is None
    assert out.reasoning == record["reasoning_text"] and out.text == "Checking." == record["sent_text"]
    assert out.tool_calls() == [{"id": record["tool_call"]["id"], "name": "get_weather",
                                 "arguments": record["tool_call"]["arguments"]}]
    assert sum(1 for k, _ in out.deltas if k == "tool_call") == 26  # header + 25 pieces
    assert len(out.chunks) == record["chunks_sent"]
    assert final.model == "claude-emu" and final.provider_response_id == f"msg_emu{record['n']}"
    usage = final.usage
    assert usage is not None and usage["completion_tokens"] == usage["output_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert record["request"]["stream"] is True


def test_drop_mid_tool_call_names_the_tool(emu: EmulatorClient, client: anthropic.Anthropic) -> None:
    emu.script("drop", [{"fault": "no_finish", "text": "Let me look.",
                         "tool_call": {"name": "search", "arguments": {"q": "cats"}}}])
    out = RecordingOutput()
    final = stream_messages(client, req("drop"), out)
    assert code_of(final) == ("transient", "no_finish_reason")
    assert final.dropped_tool_names == ("search",) and final.dropped_tool_indexes == (0,)
    assert out.text == "Let me look." and final.finish_reason is None and out.exc is None


def test_disconnect_mid_tool_call_keeps_partial_state(emu: EmulatorClient,
                                                      client: anthropic.Anthropic) -> None:
    emu.script("cut", [{"fault": "disconnect", "after": 5,
                        "tool_call": {"name": "search", "arguments": {"q": "cats"}}}])
    out = RecordingOutput()
    final = stream_messages(client, req("cut"), out)
    assert isinstance(out.exc, httpx2.RemoteProtocolError)
    assert code_of(final) == ("transient", "connection_error")
    assert final.dropped_tool_names == ("search",) and final.model == "claude-emu"


def test_no_message_stop_after_text(emu: EmulatorClient, client: anthropic.Anthropic) -> None:
    emu.script("nofin", [{"fault": "no_finish"}])
    out = RecordingOutput()
    final = stream_messages(client, req("nofin"), out)
    assert out.text == only(emu, "nofin")["text"]
    assert code_of(final) == ("transient", "no_finish_reason") and final.finish_reason is None


def test_empty_stream(emu: EmulatorClient, client: anthropic.Anthropic) -> None:
    emu.script("empty", [{"fault": "empty"}])
    out = RecordingOutput()
    final = stream_messages(client, req("empty"), out)
    assert out.chunks == [] and out.deltas == []
    assert code_of(final)[1] == "empty_stream"
    assert final.error is not None and "empty stream" in final.error.message


@pytest.mark.parametrize(("step", "expected"), [
    ({}, ("transient", "provider_error")),
    ({"error_type": "api_error", "message": "Internal server error"}, ("transient", "provider_error")),
    ({"error_type": "invalid_request_error", "message": "messages: bad"}, ("final", "provider_error")),
    ({"error_type": "invalid_request_error",
      "message": "prompt is too long: 210000 tokens > 200000 maximum"}, ("context_overflow", "context_overflow")),
])
def test_error_event_in_the_stream(emu: EmulatorClient, client: anthropic.Anthropic,
                                   step: dict[str, Any], expected: tuple[str, str]) -> None:
    emu.script("evt", [{"fault": "error_event", "after": 4, **step}])
    out = RecordingOutput()
    final = stream_messages(client, req("evt"), out)
    assert code_of(final) == expected
    assert out.text == only(emu, "evt")["sent_text"] != ""
    assert len(out.chunks) == 5  # 4 events + the error event


def test_rate_limit_is_transient_with_retry_after(emu: EmulatorClient,
                                                  client: anthropic.Anthropic) -> None:
    emu.script("429", [{"fault": "status", "status": 429, "retry_after": 2}])
    out = RecordingOutput()
    final = stream_messages(client, req("429"), out, secrets=["test-key"])
    assert isinstance(out.exc, anthropic.RateLimitError)
    assert code_of(final) == ("transient", "rate_limited")
    assert final.error is not None and final.error.status == 429 and final.error.retry_after_s == 2.0


def test_pings_are_not_chunks(emu: EmulatorClient, client: anthropic.Anthropic) -> None:
    emu.script("ka", [{"fault": "keepalive", "after": 3, "stall_s": 0.2, "keepalive_every_s": 0.05}])
    out = RecordingOutput()
    final = stream_messages(client, req("ka"), out)
    record = only(emu, "ka")
    assert final.ok and record["keepalives_sent"] >= 3
    assert len(out.chunks) == record["chunks_sent"] == 13


def test_malformed_event(emu: EmulatorClient, client: anthropic.Anthropic) -> None:
    emu.script("bad", [{"fault": "malformed", "after": 3}])
    out = RecordingOutput()
    final = stream_messages(client, req("bad"), out)
    assert isinstance(out.exc, MalformedStreamError)
    assert code_of(final) == ("transient", "malformed_stream")


def test_read_timeout_mid_stream(emu: EmulatorClient, client: anthropic.Anthropic) -> None:
    emu.script("stall", [{"fault": "stall", "after": 3, "stall_s": 1.0}])
    final = stream_messages(client, req("stall"), RecordingOutput(),
                            timeout=anthropic.Timeout(5.0, read=0.2))
    assert code_of(final) == ("transient", "read_timeout")


def test_non_streaming_fall_back_delivers_deltas(emu: EmulatorClient,
                                                 client: anthropic.Anthropic) -> None:
    emu.script("whole", [{"reasoning": "plan", "text": "Sure.",
                          "tool_call": {"name": "f", "arguments": {"x": 2}}}])
    out = RecordingOutput()
    final = complete_messages(client, req("whole", stream=True, temperature=0.5), out)
    record = only(emu, "whole")
    assert final.ok and final.finish_reason == "tool_calls" and len(out.chunks) == 1
    assert out.reasoning == "plan" and out.text == "Sure."
    assert out.tool_calls() == [{"id": record["tool_call"]["id"], "name": "f", "arguments": '{"x":2}'}]
    assert record["stream"] is False and "stream" not in record["request"]
    assert record["request"]["temperature"] == 0.5  # an unnamed SDK parameter, via extra_body
    assert final.usage is not None
    assert final.usage["completion_tokens"] == final.usage["output_tokens"] > 0


@pytest.mark.parametrize(("fault", "expected"), [
    ("no_finish", ("transient", "no_finish_reason")),  # a tool_use without stop_reason
    ("error_event", ("transient", "provider_error")),
    ("empty", ("transient", "malformed_stream")),
])
def test_non_streaming_faults(emu: EmulatorClient, client: anthropic.Anthropic, fault: str,
                              expected: tuple[str, str]) -> None:
    emu.script("wf", [{"fault": fault, "tool_call": {"name": "f", "arguments": "{}"}}])
    assert code_of(complete_messages(client, req("wf"), RecordingOutput())) == expected


def test_adapter_make_client_and_run(emu: EmulatorClient, emulator: EmulatorProcess,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SF_TEST_ANTHROPIC_KEY", "sk-ant-test-123456")
    profile = {"name": "ant", "kind": "anthropic", "base_url": emulator.base_url + "/v1",
               "api_key_env": "SF_TEST_ANTHROPIC_KEY"}
    settings = AttemptSettings(connect_timeout_s=5.0, read_timeout_s=5.0)
    with ADAPTER.make_client(profile) as made:
        assert made.max_retries == 0 and str(made.base_url).rstrip("/") == emulator.base_url
        out = RecordingOutput()
        final = ADAPTER.run(made, req("made"), out, settings, ())
        whole = ADAPTER.run(made, req("made"), RecordingOutput(),
                            AttemptSettings(streaming=False), ())
    assert final.ok and whole.ok and out.text == emu.log("made")[0]["text"]
    assert [r["stream"] for r in emu.log("made")] == [True, False]
    assert all(r["auth_present"] for r in emu.log("made"))


def test_sdk_retries_are_disabled(emu: EmulatorClient, emulator: EmulatorProcess) -> None:
    emu.script("500", [{"fault": "status", "status": 500}] * 3)
    out = RecordingOutput()
    with anthropic.Anthropic(base_url=emulator.base_url, api_key="k", max_retries=3) as retrying:
        final = stream_messages(retrying, req("500"), out)
    assert isinstance(out.exc, anthropic.InternalServerError) and code_of(final)[0] == "transient"
    assert len(emu.log("500")) == 1


def test_streaming_rejection_is_named_for_the_fall_back(emu: EmulatorClient,
                                                        client: anthropic.Anthropic) -> None:
    emu.script("nostream", [{"fault": "status", "status": 400,
                             "message": "stream: streaming is not supported for this model"}])
    final = stream_messages(client, req("nostream"), RecordingOutput())
    assert code_of(final) == ("final", "streaming_unsupported")
