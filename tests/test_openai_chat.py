"""workers/openai_chat.py: the chunk assembler on dicts, the SSE framer on bytes,
and stream_chat/complete_chat/ADAPTER driven by the real openai SDK against a
real HTTP server on 127.0.0.1 (a scripted http.server, started and joined here)."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx2
import openai
import orjson
import pytest

from streamfence.protocol.internal.outcome import AttemptDiag, AttemptError, AttemptOutcome
from streamfence.protocol.internal.workers import AttemptSettings
from streamfence.workers.errors import MalformedStreamError
from streamfence.workers.openai_chat import (
    ADAPTER,
    ChatStreamAssembler,
    complete_chat,
    is_stream_options_rejection,
    stream_chat,
)
from streamfence.workers.output import RecordingOutput
from streamfence.workers.sse import iter_sse_events
from tests.http_stub import Reply, StubServer, stub_server

REQUEST: dict[str, Any] = {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]}


# ---- chunk builders --------------------------------------------------------

def ch(delta: dict[str, Any] | None = None, finish: str | None = None, **top: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "gpt-test",
            "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}], **top}


def tc(index: int | None, id: Any = None, name: str | None = None, args: str | None = None) -> dict[str, Any]:
    fn: dict[str, Any] = {}
    if name is not None:
        fn["name"] = name
    if args is not None:
        fn["arguments"] = args
    return {"index": index, "id": id, "type": "function", "function": fn}


def tools(*calls: dict[str, Any]) -> dict[str, Any]:
    return ch({"tool_calls": list(calls)})


def frag(index: int, args: str, id: str | None = None, name: str | None = None) -> tuple[str, Any]:
    return ("tool_call", {"index": index, "id": id, "name": name, "arguments": args})


USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def run(chunks: list[dict[str, Any]]) -> tuple[RecordingOutput, AttemptOutcome]:
    out = RecordingOutput()
    asm = ChatStreamAssembler(out)
    for chunk in chunks:
        asm.feed(chunk)
    return out, asm.finish()


# ---- the assembler, table-driven -------------------------------------------

@dataclass
class Case:
    chunks: list[dict[str, Any]]
    deltas: list[tuple[str, Any]] | None = None  # exact delta list, when given
    final: dict[str, Any] = field(default_factory=dict)  # expected outcome fields
    error: tuple[str, str] | None = None  # (class, code)
    tool_calls: list[dict[str, Any]] | None = None  # as the sink assembles them


CASES: dict[str, Case] = {
    "text_stop": Case(
        [ch({"role": "assistant", "content": ""}), ch({"content": "Hel"}), ch({"content": "lo"}),
         ch(finish="stop"), {"id": "chatcmpl-1", "model": "gpt-test", "choices": [], "usage": USAGE}],
        deltas=[("text", "Hel"), ("text", "lo")],
        final={"ok": True, "finish_reason": "stop", "usage": USAGE, "model": "gpt-test",
               "provider_response_id": "chatcmpl-1", "dropped_tool_names": [],
               "dropped_tool_indexes": [], "error": None, "diag": AttemptDiag()}),
    "index_reused_with_new_id_opens_slot": Case(
        [tools(tc(0, "call_a", "read", "")), tools(tc(0, None, None, '{"p":')),
         tools(tc(0, None, None, '"x"}')), tools(tc(0, "call_b", "write", '{"q":1}')),
         ch(finish="tool_calls")],
        deltas=[frag(0, "", "call_a", "read"), frag(0, '{"p":'), frag(0, '"x"}'),
                frag(1, '{"q":1}', "call_b", "write")],
        final={"ok": True, "finish_reason": "tool_calls"},
        tool_calls=[{"id": "call_a", "name": "read", "arguments": '{"p":"x"}'},
                    {"id": "call_b", "name": "write", "arguments": '{"q":1}'}]),
    "same_id_resent_stays_in_slot": Case(
        [tools(tc(0, "a", "f", '{"k"')), tools(tc(0, "a", None, ":1}")), ch(finish="tool_calls")],
        tool_calls=[{"id": "a", "name": "f", "arguments": '{"k":1}'}], final={"ok": True}),
    "slots_are_normalized_in_opening_order": Case(
        [tools(tc(3, "x", "f", "{}")), tools(tc(3, "y", "g", "{}")), tools(tc(7, "z", "h", "{}")),
         ch(finish="tool_calls")],
        tool_calls=[{"id": "x", "name": "f", "arguments": "{}"}, {"id": "y", "name": "g", "arguments": "{}"},
                    {"id": "z", "name": "h", "arguments": "{}"}]),
    "integer_ids_are_stringified": Case(
        [tools(tc(0, 7, "f", "{}")), tools(tc(0, 8, "g", "{}")), ch(finish="tool_calls")],
        deltas=[frag(0, "{}", "7", "f"), frag(1, "{}", "8", "g")]),
    "name_assigned_not_appended": Case(
        [tools(tc(0, "a", "read_file", '{"a"')), tools(tc(0, None, "read_file", ":1}")),
         ch(finish="tool_calls")],
        tool_calls=[{"id": "a", "name": "read_file", "arguments": '{"a":1}'}]),
    "name_after_arguments_opens_with_buffer": Case(
        [tools(tc(0, "a", None, '{"a"')), tools(tc(0, None, "f", ":1")), tools(tc(0, None, None, "}")),
         ch(finish="tool_calls")],
        deltas=[frag(0, '{"a":1', "a", "f"), frag(0, "}")]),
    "missing_index_means_zero": Case(
        [tools(tc(None, "a", "f", "{}")), ch(finish="tool_calls")], deltas=[frag(0, "{}", "a", "f")]),
    "arguments_as_object": Case(
        [tools({"index": 0, "id": "a", "function": {"name": "f", "arguments": {"k": 1}}}),
         ch(finish="tool_calls")], deltas=[frag(0, '{"k":1}', "a", "f")]),
    "reasoning_in_both_fields": Case(
        [ch({"reasoning_content": "think "}), ch({"reasoning": "more"}), ch({"content": "answer"}),
         ch(finish="stop")],
        deltas=[("reasoning", "think "), ("reasoning", "more"), ("text", "answer")]),
    "list_of_blocks_content": Case(
        [ch({"content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}},
                         {"type": "text", "text": "b"}]}),
         ch({"content": [{"type": "thinking", "thinking": [{"type": "text", "text": "hm"}]}]}),
         ch(finish="stop")],
        deltas=[("text", "ab"), ("reasoning", "hm")]),
    "refusal": Case(
        [ch({"refusal": "I can't"}), ch({"refusal": " help."}), ch(finish="stop")],
        deltas=[("refusal", "I can't"), ("refusal", " help.")], final={"ok": True}),
    "choiceless_usage_chunk": Case(
        [ch({"content": "x"}), ch(finish="stop"), {"id": "c", "choices": [], "usage": USAGE}],
        final={"ok": True, "usage": USAGE}),
    "usage_without_finish_counts_as_finished": Case(
        [ch({"content": "x"}), {"id": "c", "choices": [], "usage": USAGE}],
        final={"ok": True, "finish_reason": "stop"}),
    "in_stream_server_error_is_transient": Case(
        [ch({"content": "x"}), {"error": {"message": "The server had an error", "type": "server_error"}},
         ch({"content": "ignored"})],
        deltas=[("text", "x")], error=("transient", "provider_error"), final={"finish_reason": None}),
    "in_stream_overloaded_is_transient": Case(
        [{"error": {"message": "Overloaded", "type": "overloaded_error"}}], error=("transient", "provider_error")),
    "in_stream_invalid_request_is_final": Case(
        [{"error": {"message": "Invalid tool schema", "type": "invalid_request_error"}}],
        error=("final", "provider_error")),
    "in_stream_context_error": Case(
        [{"error": {"message": "This model's maximum context length is 8192 tokens",
                    "code": "context_length_exceeded"}}], error=("context_overflow", "context_overflow")),
    "in_stream_status_code": Case(
        [{"error": {"message": "upstream failed", "code": 502}}], error=("transient", "server_error")),
    "choiceless_error_fields": Case(
        [{"id": "c", "choices": [], "error_type": "validation_error", "error_message": "bad"}],
        error=("final", "provider_error")),
    "choiceless_last_one_is_stop": Case(
        [ch({"content": "x"}), {"id": "c", "choices": [], "lastOne": True}], final={"ok": True, "finish_reason": "stop"}),
    "error_finish_with_sse_text_is_held_back": Case(
        [ch({"content": "data: "}), ch({"content": '{"error": {"message": "Upstream 503", "code": 503}}\n\n'}),
         ch(finish="error")],
        deltas=[], error=("transient", "unavailable"), final={"finish_reason": "error"}),
    "error_finish_with_json_text": Case(
        [ch({"content": '{"error": {"message": "key sk-abcdefghijklmnop invalid", "code": 401}}'}),
         ch(finish="error")], deltas=[], error=("final", "auth_failed")),
    "error_finish_with_plain_text": Case(
        [ch({"content": "Network connection lost."}), ch(finish="error")],
        deltas=[("text", "Network connection lost.")], error=("transient", "provider_error")),
    "sse_looking_start_is_released": Case(
        [ch({"content": "data"}), ch({"content": " science"}), ch({"content": " rocks"}), ch(finish="stop")],
        deltas=[("text", "data science"), ("text", " rocks")]),
    "json_mode_output_is_not_held": Case(
        [ch({"content": "{"}), ch({"content": '"name": 1}'}), ch(finish="stop")],
        deltas=[("text", '{"name": 1}')]),
    "held_whitespace_flushed_at_finish": Case(
        [ch({"content": "\n"}), ch(finish="stop")], deltas=[("text", "\n")], final={"ok": True}),
    "no_finish_with_text_is_incomplete": Case(
        [ch({"content": "partial"})], deltas=[("text", "partial")],
        error=("transient", "no_finish_reason"),
        final={"ok": False, "finish_reason": None, "dropped_tool_names": [], "dropped_tool_indexes": []}),
    "no_finish_with_tool_call_in_flight_drops_it": Case(
        [ch({"content": "Let me look."}), tools(tc(0, "a", "search", '{"q": "ca'))],
        error=("transient", "no_finish_reason"),
        final={"dropped_tool_names": ["search"], "dropped_tool_indexes": [0]}),
    "no_finish_drops_complete_looking_calls_too": Case(
        [tools(tc(0, "a", "f", "{}")), tools(tc(1, "b", "g", "{}"))],
        error=("transient", "no_finish_reason"),
        final={"dropped_tool_names": ["f", "g"], "dropped_tool_indexes": [0, 1]}),
    "empty_stream": Case([], error=("transient", "empty_stream"), final={"ok": False}),
    "role_only_stream_is_empty": Case(
        [ch({"role": "assistant", "content": ""}), {"id": "c", "choices": [], "usage": USAGE}],
        error=("transient", "empty_stream")),
    "truncated_tool_arguments_are_dropped_as_length": Case(
        [tools(tc(0, "a", "ok_tool", "{}")), tools(tc(1, "b", "cut_tool", '{"path": "/tm')),
         ch(finish="tool_calls")],
        final={"ok": True, "finish_reason": "length", "dropped_tool_names": ["cut_tool"],
               "dropped_tool_indexes": [1], "error": None}),
    "nameless_call_is_dropped": Case(
        [tools(tc(0, "a", None, "{}")), ch(finish="tool_calls")],
        deltas=[], final={"ok": True, "finish_reason": "length", "dropped_tool_names": ["unknown"]}),
    "empty_arguments_with_finish_are_fine": Case(
        [tools(tc(0, "a", "now", "")), ch(finish="tool_calls")], final={"ok": True, "finish_reason": "tool_calls"}),
    "length_passes_through": Case([ch({"content": "x"}), ch(finish="length")], final={"ok": True, "finish_reason": "length"}),
    "content_filter_passes_through": Case(
        [ch({"content": "x"}), ch(finish="content_filter")], final={"ok": True, "finish_reason": "content_filter"}),
    "finish_alias_normalized": Case([ch({"content": "x"}), ch(finish="end_turn")], final={"finish_reason": "stop"}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_assembler(name: str) -> None:
    case = CASES[name]
    out, final = run(case.chunks)
    if case.deltas is not None:
        assert out.deltas == case.deltas
    for key, value in case.final.items():
        got = getattr(final, key)
        assert (list(got) if isinstance(got, tuple) else got) == value, key
    if case.error is None:
        assert final.error is None and final.ok is True
    else:
        assert final.ok is False and final.error is not None
        assert (final.error.error_class, final.error.code) == case.error, final.error
        assert "sk-abc" not in final.error.message
    if case.tool_calls is not None:
        assert out.tool_calls() == case.tool_calls
    assert out.exc is None  # nothing raised


def test_visible_chars_count_text_and_refusal_only() -> None:
    out, _ = run([ch({"reasoning": "zzz", "content": "ab"}), ch({"refusal": "no"}), ch(finish="stop")])
    assert out.visible_chars == 4


def test_keepalive_only_stream() -> None:
    asm = ChatStreamAssembler(RecordingOutput())
    asm.keepalives = 3
    error = asm.finish().error
    assert error is not None and (error.error_class, error.code) == ("transient", "empty_sse_frames")


@pytest.mark.parametrize("chunk", [
    {"choices": "nope"}, {"choices": [{"delta": ["x"]}]}, {"choices": [{"delta": {"tool_calls": [1]}}]},
    {"choices": [{"delta": {"content": [3]}}]}])
def test_bad_chunk_shape_is_malformed(chunk: dict[str, Any]) -> None:
    with pytest.raises(MalformedStreamError):
        ChatStreamAssembler(RecordingOutput()).feed(chunk)


def test_output_errors_are_not_mistaken_for_malformed_chunks() -> None:
    class Broken(RecordingOutput):
        def delta(self, kind: str, data: Any) -> None:
            raise TypeError("sink bug")

    asm = ChatStreamAssembler(Broken())
    with pytest.raises(TypeError, match="sink bug"):
        asm.feed(ch({"content": "hello there"}))


# ---- SSE framing -------------------------------------------------------------

def events(*reads: bytes) -> list[tuple[bytes | None, bytes | None]]:
    return list(iter_sse_events(iter(reads)))


@pytest.mark.parametrize(("reads", "expected"), [
    ((b"data: a\n\ndata: b\n\n",), [(None, b"a"), (None, b"b")]),
    ((b"data: a\r\n\r\n",), [(None, b"a")]),
    ((b"data: a\r", b"\n\r", b"\ndata: b\r\r"), [(None, b"a"), (None, b"b")]),
    ((b"data: line1\ndata: line2\n\n",), [(None, b"line1\nline2")]),
    ((b": keep-alive\n\n: ping\ndata:x\n\n",), [(None, b"x")]),
    ((b"event: error\ndata: {}\n\n",), [(b"error", b"{}")]),
    ((b"event: ping\n\nid: 3\n\n",), [(b"ping", None)]),
    ((b"\xef\xbb\xbfdata: a\n\n",), [(None, b"a")]),
    ((b"data: a\n\ndata: cut-off",), [(None, b"a")]),
    ((b"data: a\n\ndata: no-blank-line\n",), [(None, b"a")]),
    ((b"data: ", b"", b"split\n", b"\n"), [(None, b"split")]),
    ((b"data\ndata\n\ndata:x\nid: 1\nretry: 5\nfoo: bar\n\n",), [(None, b"\n"), (None, b"x")]),
])
def test_sse_framing(reads: tuple[bytes, ...], expected: list[tuple[bytes | None, bytes | None]]) -> None:
    assert events(*reads) == expected


def test_sse_framing_is_independent_of_read_boundaries() -> None:
    body = b": c\r\ndata: {\"a\": 1}\r\n\r\nevent: x\rdata: 2\r\rdata: 3\n\n"
    whole = events(body)
    assert whole == [(None, b'{"a": 1}'), (b"x", b"2"), (None, b"3")]
    assert events(*(body[i:i + 1] for i in range(len(body)))) == whole


# ---- a real HTTP server ------------------------------------------------------

def sse(*chunks: Any, done: bool = True) -> list[bytes]:
    parts = [b"data: " + orjson.dumps(c) + b"\n\n" if not isinstance(c, bytes) else c for c in chunks]
    return [*parts, b"data: [DONE]\n\n"] if done else parts


class Provider(StubServer):
    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key="test", **{"max_retries": 0, **kwargs})


@pytest.fixture
def provider() -> Iterator[Provider]:
    with stub_server(Provider) as s:
        yield s


@pytest.fixture
def client(provider: Provider) -> Iterator[openai.OpenAI]:
    with provider.client() as c:
        yield c


def test_stream_chat_over_http(provider: Provider, client: openai.OpenAI) -> None:
    provider.replies = [Reply(sse(
        b": keep-alive\n\n", ch({"role": "assistant", "content": ""}), ch({"content": "Hi"}),
        b": ping\n\n", ch({"content": " there"}), tools(tc(0, "call_1", "f", '{"a":')),
        tools(tc(0, None, None, "1}")), ch(finish="tool_calls"),
        {"id": "chatcmpl-1", "choices": [], "usage": USAGE}))]
    out = RecordingOutput()
    final = stream_chat(client, {**REQUEST, "stream_options": {"x": 1}}, out)
    assert final.ok and final.finish_reason == "tool_calls" and final.usage == USAGE
    assert out.text == "Hi there"
    assert out.tool_calls() == [{"id": "call_1", "name": "f", "arguments": '{"a":1}'}]
    assert len(out.chunks) == 7  # comments and [DONE] are not chunks
    sent = provider.requests[0]
    assert sent["stream"] is True and sent["stream_options"] == {"x": 1, "include_usage": True}


def test_compressed_stream(provider: Provider, client: openai.OpenAI) -> None:
    body = gzip.compress(b"".join(sse(ch({"content": "zipped"}), ch(finish="stop"))))
    provider.replies = [Reply([body[:10], body[10:]], headers={"Content-Encoding": "gzip"})]
    out = RecordingOutput()
    assert stream_chat(client, REQUEST, out).ok and out.text == "zipped"


def test_stream_chat_without_stream_options(provider: Provider, client: openai.OpenAI) -> None:
    provider.replies = [Reply(sse(ch({"content": "x"}), ch(finish="stop")))]
    final = stream_chat(client, {**REQUEST, "stream_options": {"include_usage": True}},
                        RecordingOutput(), include_usage=False)
    assert final.ok and "stream_options" not in provider.requests[0]


def code_of(final: AttemptOutcome) -> tuple[str, str]:
    assert final.ok is False and final.error is not None
    return final.error.error_class, final.error.code


def test_stream_options_rejection_is_retried_without_them(provider: Provider,
                                                          client: openai.OpenAI) -> None:
    body = orjson.dumps({"error": {"message": "Unrecognized request argument supplied: stream_options",
                                   "type": "invalid_request_error"}})
    provider.replies = [Reply([body], status=400, ctype="application/json"),
                        Reply(sse(ch({"content": "x"}), ch(finish="stop")))]
    out = RecordingOutput()
    final = stream_chat(client, REQUEST, out)
    assert final.ok and final.stream_options_rejected and out.text == "x" and out.exc is None
    assert "stream_options" in provider.requests[0] and "stream_options" not in provider.requests[1]
    # Without include_usage the same 400 is the attempt's (final) error.
    provider.replies = [Reply([body], status=400, ctype="application/json")]
    out = RecordingOutput()
    final = stream_chat(client, REQUEST, out, include_usage=False)
    assert code_of(final) == ("final", "stream_options_rejected") and not final.stream_options_rejected
    assert isinstance(out.exc, openai.BadRequestError) and is_stream_options_rejection(out.exc)
    assert not is_stream_options_rejection(ValueError("stream_options"))


def test_malformed_data(provider: Provider, client: openai.OpenAI) -> None:
    provider.replies = [Reply(sse(ch({"content": "x"}), b"data: {not json\n\n"))]
    out = RecordingOutput()
    assert code_of(stream_chat(client, REQUEST, out)) == ("transient", "malformed_stream")
    assert isinstance(out.exc, MalformedStreamError)


def test_empty_data_frames_are_keepalives(provider: Provider, client: openai.OpenAI) -> None:
    provider.replies = [Reply([b"data:\n\n", b"event: ping\n\n", b"data: \n\n"])]
    out = RecordingOutput()
    final = stream_chat(client, REQUEST, out)
    assert out.chunks == [] and code_of(final) == ("transient", "empty_sse_frames")


def test_error_event(provider: Provider, client: openai.OpenAI) -> None:
    provider.replies = [Reply(sse(ch({"content": "x"}), b"event: error\ndata: Network connection lost.\n\n",
                                  ch({"content": "never"})))]
    out = RecordingOutput()
    final = stream_chat(client, REQUEST, out)
    assert out.text == "x" and code_of(final) == ("transient", "provider_error")
    assert out.exc is None  # an in-stream error, not an exception


def test_drop_mid_body_keeps_partial_state(provider: Provider, client: openai.OpenAI) -> None:
    provider.replies = [Reply(sse(ch({"content": "Looking"}), tools(tc(0, "c", "search", '{"q"')), done=False),
                              end="drop")]
    out = RecordingOutput()
    final = stream_chat(client, REQUEST, out)
    assert isinstance(out.exc, httpx2.RemoteProtocolError)  # raw: the wrapper does not wrap it
    assert code_of(final) == ("transient", "connection_error")
    assert final.dropped_tool_names == ("search",) and final.dropped_tool_indexes == (0,)
    assert final.model == "gpt-test" and out.text == "Looking"


def test_drop_after_finish_chunk_is_success(provider: Provider, client: openai.OpenAI) -> None:
    provider.replies = [Reply(sse(ch({"content": "done"}), ch(finish="stop"), done=False), end="drop")]
    out = RecordingOutput()
    final = stream_chat(client, REQUEST, out)
    assert final.ok and final.finish_reason == "stop" and out.exc is None


def test_read_timeout_mid_stream(provider: Provider, client: openai.OpenAI) -> None:
    provider.replies = [Reply(sse(ch({"content": "x"}), done=False), end="hang")]
    out = RecordingOutput()
    final = stream_chat(client, REQUEST, out, timeout=httpx2.Timeout(5.0, read=0.3))
    assert code_of(final) == ("transient", "read_timeout") and isinstance(out.exc, httpx2.ReadTimeout)


def test_sdk_retries_are_disabled(provider: Provider) -> None:
    provider.replies = [Reply([b'{"error": {"message": "boom", "type": "server_error"}}'], status=500,
                              ctype="application/json")]
    out = RecordingOutput()
    with provider.client(max_retries=3) as retrying:
        final = stream_chat(retrying, REQUEST, out)
    assert code_of(final) == ("transient", "server_error")
    assert final.error is not None and final.error.status == 500
    assert isinstance(out.exc, openai.InternalServerError) and len(provider.requests) == 1


def test_json_answer_to_a_stream_request(provider: Provider, client: openai.OpenAI) -> None:
    completion = {"id": "chatcmpl-9", "model": "gpt-test", "usage": USAGE, "choices": [
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "whole"}}]}
    provider.replies = [Reply([orjson.dumps(completion)], ctype="application/json")]
    out = RecordingOutput()
    final = stream_chat(client, REQUEST, out)
    assert out.text == "whole" and final.ok and final.provider_response_id == "chatcmpl-9"


def test_complete_chat(provider: Provider, client: openai.OpenAI) -> None:
    completion = {"id": "chatcmpl-2", "model": "gpt-test", "usage": USAGE, "choices": [
        {"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": "Sure.", "reasoning_content": "plan",
            "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                           {"id": "b", "type": "function", "function": {"name": "g", "arguments": '{"x":2}'}}]}}]}
    provider.replies = [Reply([orjson.dumps(completion)], ctype="application/json")]
    out = RecordingOutput()
    final = complete_chat(client, {**REQUEST, "stream_options": {"include_usage": True}}, out)
    assert final.ok and final.finish_reason == "tool_calls" and final.usage == USAGE
    assert out.reasoning == "plan" and out.text == "Sure." and len(out.chunks) == 1
    assert out.tool_calls() == [{"id": "a", "name": "f", "arguments": "{}"},
                                {"id": "b", "name": "g", "arguments": '{"x":2}'}]
    assert "stream" not in provider.requests[0] and "stream_options" not in provider.requests[0]


def test_complete_chat_error_body(provider: Provider, client: openai.OpenAI) -> None:
    provider.replies = [Reply([b'{"error": {"message": "overloaded", "type": "server_error"}}'],
                              ctype="application/json")]
    assert code_of(complete_chat(client, REQUEST, RecordingOutput()))[0] == "transient"


def test_complete_chat_status_error(provider: Provider, client: openai.OpenAI) -> None:
    provider.replies = [Reply([b'{"error": {"message": "no such model", "type": "invalid_request_error"}}'],
                              status=404, ctype="application/json")]
    out = RecordingOutput()
    assert code_of(complete_chat(client, REQUEST, out)) == ("final", "not_found")
    assert isinstance(out.exc, openai.NotFoundError)


def test_adapter_runs_with_the_settings(provider: Provider, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SF_TEST_OPENAI_KEY", "plainsecret98765")
    profile = {"name": "p", "kind": "openai", "base_url": provider.base_url,
               "api_key_env": "SF_TEST_OPENAI_KEY"}
    provider.replies = [Reply(sse(ch({"content": "streamed"}), ch(finish="stop"))),
                        Reply([orjson.dumps({"id": "c", "choices": [{"index": 0, "finish_reason": "stop",
                              "message": {"role": "assistant", "content": "whole"}}]})],
                              ctype="application/json"),
                        Reply([b'{"error": {"message": "bad key plainsecret98765"}}'],
                              status=401, ctype="application/json")]
    client = ADAPTER.make_client(profile)
    try:
        out = RecordingOutput()
        final = ADAPTER.run(client, REQUEST, out, AttemptSettings(include_usage=False), ())
        assert final.ok and out.text == "streamed" and "stream_options" not in provider.requests[0]
        out = RecordingOutput()
        final = ADAPTER.run(client, REQUEST, out, AttemptSettings(streaming=False), ())
        assert final.ok and out.text == "whole" and "stream" not in provider.requests[1]
        final = ADAPTER.run(client, REQUEST, RecordingOutput(), AttemptSettings(),
                            ["plainsecret98765"])
        assert code_of(final) == ("final", "auth_failed")
        assert isinstance(final.error, AttemptError)
        assert "bad key" in final.error.message and "plainsecret" not in final.error.message
    finally:
        client.close()
