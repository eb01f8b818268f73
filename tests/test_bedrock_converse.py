"""workers/bedrock_converse.py: the event assembler on dicts, and stream_converse /
complete_converse / ADAPTER.run driven by a real botocore client against the real
emulator (a subprocess on 127.0.0.1 speaking Bedrock's binary event stream).

Also the measured facts the design rests on: what botocore raises for each fault,
and what its read timeout does (and does not do) inside the event-stream loop.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import botocore.exceptions
import pytest
import urllib3.exceptions

from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess
from streamfence.protocol.internal.outcome import AttemptDiag, AttemptOutcome
from streamfence.protocol.internal.workers import AttemptSettings
from streamfence.workers.assembly import failed_outcome
from streamfence.workers.bedrock_converse import (
    ADAPTER,
    ConverseStreamAssembler,
    classify_bedrock,
    complete_converse,
    is_streaming_denied,
    make_client,
    stream_converse,
)
from streamfence.workers.output import RecordingOutput

MESSAGES: list[Any] = [{"role": "user", "content": [{"text": "hi"}]}]


def code_of(final: AttemptOutcome) -> tuple[str, str]:
    assert final.ok is False and final.error is not None
    return final.error.error_class, final.error.code


# ---- event builders --------------------------------------------------------

def start() -> dict[str, Any]:
    return {"messageStart": {"role": "assistant"}}


def text(i: int, t: str) -> dict[str, Any]:
    return {"contentBlockDelta": {"contentBlockIndex": i, "delta": {"text": t}}}


def think(i: int, t: str) -> dict[str, Any]:
    return {"contentBlockDelta": {"contentBlockIndex": i, "delta": {"reasoningContent": {"text": t}}}}


def tool_start(i: int, tid: str, name: str) -> dict[str, Any]:
    return {"contentBlockStart": {"contentBlockIndex": i,
                                  "start": {"toolUse": {"toolUseId": tid, "name": name}}}}


def tool_in(i: int, piece: str) -> dict[str, Any]:
    return {"contentBlockDelta": {"contentBlockIndex": i, "delta": {"toolUse": {"input": piece}}}}


def stop_block(i: int) -> dict[str, Any]:
    return {"contentBlockStop": {"contentBlockIndex": i}}


def stop(reason: str) -> dict[str, Any]:
    return {"messageStop": {"stopReason": reason}}


META = {"metadata": {"usage": {"inputTokens": 3, "outputTokens": 2, "totalTokens": 5},
                     "metrics": {"latencyMs": 9}}}
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def frag(index: int, args: str, id: str | None = None, name: str | None = None) -> tuple[str, Any]:
    return ("tool_call", {"index": index, "id": id, "name": name, "arguments": args})


# ---- the assembler, table-driven -------------------------------------------

@dataclass
class Case:
    events: list[dict[str, Any]]
    deltas: list[tuple[str, Any]] | None = None
    final: dict[str, Any] = field(default_factory=dict)
    error: tuple[str, str] | None = None
    tool_calls: list[dict[str, Any]] | None = None


CASES: dict[str, Case] = {
    "text_end_turn": Case(
        [start(), text(0, "Hel"), text(0, "lo"), stop_block(0), stop("end_turn"), META],
        deltas=[("text", "Hel"), ("text", "lo")],
        final={"ok": True, "finish_reason": "stop", "usage": USAGE, "dropped_tool_names": [],
               "dropped_tool_indexes": [], "error": None, "diag": AttemptDiag()}),
    "reasoning_then_text_signature_ignored": Case(
        [start(), think(0, "hmm "), think(0, "ok"),
         {"contentBlockDelta": {"contentBlockIndex": 0,
                                "delta": {"reasoningContent": {"signature": "sig"}}}},
         stop_block(0), text(1, "answer"), stop("end_turn")],
        deltas=[("reasoning", "hmm "), ("reasoning", "ok"), ("text", "answer")]),
    "two_tools_by_block_index": Case(
        [start(), text(0, "Looking."), tool_start(1, "t1", "read"), tool_in(1, '{"p":'),
         tool_in(1, '"x"}'), stop_block(1), tool_start(2, "t2", "write"), tool_in(2, "{}"),
         stop_block(2), stop("tool_use")],
        deltas=[("text", "Looking."), frag(0, "", "t1", "read"), frag(0, '{"p":'), frag(0, '"x"}'),
                frag(1, "", "t2", "write"), frag(1, "{}")],
        final={"ok": True, "finish_reason": "tool_calls"},
        tool_calls=[{"id": "t1", "name": "read", "arguments": '{"p":"x"}'},
                    {"id": "t2", "name": "write", "arguments": "{}"}]),
    "tool_without_input": Case(
        [tool_start(0, "t", "now"), stop_block(0), stop("tool_use")],
        final={"ok": True, "finish_reason": "tool_calls", "dropped_tool_names": []}),
    "input_before_start_is_held": Case(
        [tool_in(0, '{"a"'), tool_start(0, "t", "f"), tool_in(0, ":1}"), stop("tool_use")],
        deltas=[frag(0, '{"a"', "t", "f"), frag(0, ":1}")],
        tool_calls=[{"id": "t", "name": "f", "arguments": '{"a":1}'}]),
    "stop_sequence_is_stop": Case([text(0, "x"), stop("stop_sequence")],
                                  final={"ok": True, "finish_reason": "stop"}),
    "max_tokens_is_length": Case([text(0, "x"), stop("max_tokens")],
                                 final={"ok": True, "finish_reason": "length"}),
    "context_window_stop_is_length": Case([text(0, "x"), stop("model_context_window_exceeded")],
                                          final={"ok": True, "finish_reason": "length"}),
    "guardrail_is_content_filter": Case([text(0, "no"), stop("guardrail_intervened")],
                                        final={"ok": True, "finish_reason": "content_filter"}),
    "content_filtered_keeps_its_name_with_a_bad_tool": Case(
        [tool_start(0, "t", "f"), tool_in(0, '{"a'), stop("content_filtered")],
        final={"ok": True, "finish_reason": "content_filter", "dropped_tool_names": ["f"]}),
    "malformed_tool_use_is_transient": Case(
        [tool_start(0, "t", "f"), tool_in(0, "{}"), stop("malformed_tool_use")],
        error=("transient", "malformed_model_output"),
        final={"dropped_tool_names": ["f"], "dropped_tool_indexes": [0]}),
    "truncated_input_dropped_as_length": Case(
        [tool_start(0, "a", "ok_tool"), tool_in(0, "{}"), tool_start(1, "b", "cut_tool"),
         tool_in(1, '{"path": "/tm'), stop("tool_use"), META],
        final={"ok": True, "finish_reason": "length", "dropped_tool_names": ["cut_tool"],
               "dropped_tool_indexes": [1]}),
    "nameless_call_dropped": Case(
        [tool_in(0, "{}"), stop("tool_use")], deltas=[],
        final={"ok": True, "finish_reason": "length", "dropped_tool_names": ["unknown"]}),
    "no_message_stop_after_text": Case(
        [start(), text(0, "partial"), stop_block(0)], deltas=[("text", "partial")],
        error=("transient", "no_finish_reason"),
        final={"ok": False, "finish_reason": None, "dropped_tool_names": []}),
    "no_message_stop_drops_complete_looking_calls": Case(
        [tool_start(0, "a", "f"), tool_in(0, "{}"), stop_block(0), META],
        error=("transient", "no_finish_reason"),
        final={"dropped_tool_names": ["f"], "dropped_tool_indexes": [0], "usage": USAGE}),
    "empty": Case([], error=("transient", "empty_stream"), final={"ok": False}),
    "start_and_metadata_only_is_empty": Case([start(), META], error=("transient", "empty_stream")),
    "unknown_members_are_ignored": Case(
        [{"somethingNew": {"x": 1}}, text(0, "x"), stop("end_turn")], deltas=[("text", "x")],
        final={"ok": True}),
    "bad_shape_is_malformed": Case(
        [text(0, "x"), {"contentBlockDelta": {"contentBlockIndex": 0}}, text(0, "ignored")],
        deltas=[("text", "x")], error=("transient", "malformed_stream")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_assembler(name: str) -> None:
    case = CASES[name]
    out = RecordingOutput()
    asm = ConverseStreamAssembler(out)
    for event in case.events:
        asm.feed(event)
    final = asm.finish()
    if case.deltas is not None:
        assert out.deltas == case.deltas
    for key, value in case.final.items():
        got = getattr(final, key)
        assert (list(got) if isinstance(got, tuple) else got) == value, (key, final)
    if case.error is None:
        assert final.error is None and final.ok is True
    else:
        assert code_of(final) == case.error
    if case.tool_calls is not None:
        assert out.tool_calls() == case.tool_calls


def test_an_error_raised_by_the_output_is_not_a_bad_event() -> None:
    class Broken(RecordingOutput):
        def delta(self, kind: str, data: Any) -> None:
            raise TypeError("the sink's packer failed")

    asm = ConverseStreamAssembler(Broken())
    with pytest.raises(TypeError, match="packer"):
        asm.feed(text(0, "x"))


# ---- against the emulator ----------------------------------------------------

class TimedOutput(RecordingOutput):
    """Records when each chunk arrived (liveness is what the supervisor sees)."""

    def __init__(self) -> None:
        super().__init__()
        self.chunk_times: list[float] = []

    def chunk(self, nbytes: int) -> None:
        self.chunk_times.append(time.monotonic())
        super().chunk(nbytes)


Client = Callable[..., Any]


@pytest.fixture
def clients(emulator: EmulatorProcess) -> Iterator[Client]:
    made: list[Any] = []

    def make(**profile: Any) -> Any:
        client = make_client({"name": "emu", "kind": "bedrock", "endpoint_url": emulator.base_url,
                              "region": "us-east-1", "aws_credentials": "dummy", **profile})
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def request(key: str) -> dict[str, Any]:
    return {"modelId": f"anthropic.claude-emu#{key}", "messages": MESSAGES,
            "inferenceConfig": {"maxTokens": 64}}


def run_stream(client: Any, key: str) -> tuple[TimedOutput, AttemptOutcome]:
    """stream_converse, and what the registry makes of an error opening the stream."""
    out = TimedOutput()
    try:
        final = stream_converse(client, request(key), out)
    except Exception as exc:
        final = failed_outcome(classify_bedrock(exc))
    return out, final


def test_tool_call_assembled_across_many_deltas(emu: EmulatorClient, clients: Client) -> None:
    args = {"path": "/tmp/ü.txt", "lines": list(range(20))}
    emu.script("tool", [{"tool_call": {"name": "read_file", "arguments": args}, "chunks": 30}])
    out, final = run_stream(clients(), "tool")
    record = emu.log("tool")[0]
    fragments = [d for k, d in out.deltas if k == "tool_call"]
    assert len(fragments) == 31  # the opening fragment + 30 input pieces
    assert out.tool_calls() == [{"id": record["tool_call"]["id"], "name": "read_file",
                                 "arguments": record["tool_call"]["arguments"]}]
    assert final.ok and final.finish_reason == "tool_calls"
    assert final.usage is not None and final.usage["completion_tokens"] == 30
    assert final.model == "anthropic.claude-emu#tool"
    assert final.provider_response_id == f"emu-{record['n']}"
    assert len(out.chunks) == record["chunks_sent"] and all(n > 1 for n in out.chunks)


def test_reasoning_deltas(emu: EmulatorClient, clients: Client) -> None:
    emu.script("think", [{"reasoning": True, "chunks": 5}])
    out, final = run_stream(clients(), "think")
    record = emu.log("think")[0]
    assert out.reasoning == record["reasoning_text"]
    assert out.text == record["text"] and final.finish_reason == "stop"
    kinds = [k for k, _ in out.deltas]
    assert kinds == ["reasoning"] * 5 + ["text"] * 5


def test_drop_mid_tool_call_is_named(emu: EmulatorClient, clients: Client) -> None:
    emu.script("drop", [{"fault": "disconnect", "after": 6, "text": "Let me check.", "chunks": 3,
                         "tool_call": {"name": "delete_branch", "arguments": {"name": "main"}}}])
    out = TimedOutput()
    final = stream_converse(clients(), request("drop"), out)
    assert isinstance(out.exc, urllib3.exceptions.ProtocolError)
    assert code_of(final) == ("transient", "connection_error")
    assert final.dropped_tool_names == ("delete_branch",) and final.dropped_tool_indexes == (0,)
    assert out.text == "Let me check."
    assert len(out.chunks) == 6


def test_no_message_stop_after_text(emu: EmulatorClient, clients: Client) -> None:
    emu.script("nofin", [{"fault": "no_finish"}])
    out, final = run_stream(clients(), "nofin")
    assert out.text == emu.log("nofin")[0]["text"]
    assert code_of(final) == ("transient", "no_finish_reason") and final.finish_reason is None


def test_empty_stream(emu: EmulatorClient, clients: Client) -> None:
    emu.script("empty", [{"fault": "empty"}])
    out, final = run_stream(clients(), "empty")
    assert out.deltas == [] and out.chunks == []
    assert code_of(final) == ("transient", "empty_stream")


@pytest.mark.parametrize(("exc_type", "message", "expected"), [
    ("modelStreamErrorException", "Model stream error", ("transient", "provider_error")),
    # Bedrock's own wording for a tokens-per-minute quota; errors.classify alone reads
    # "too many tokens" as a context overflow.
    ("throttlingException", "Too many tokens, please wait before trying again.",
     ("transient", "rate_limited")),
    ("serviceUnavailableException", "try later", ("transient", "provider_error")),
    ("internalServerException", "boom", ("transient", "provider_error")),
    ("validationException", "Malformed input request", ("final", "provider_error")),
    ("validationException", "Input is too long for requested model.",
     ("context_overflow", "context_overflow")),
    ("somethingUnknownException", "?", ("final", "provider_error")),
])
def test_in_stream_exception(emu: EmulatorClient, clients: Client, exc_type: str, message: str,
                             expected: tuple[str, str]) -> None:
    emu.script("exc", [{"fault": "error_event", "after": 3, "error_type": exc_type,
                        "message": message}])
    out, final = run_stream(clients(), "exc")
    assert code_of(final) == expected and out.exc is None  # an in-stream error
    assert len(out.chunks) == 4  # three events and the exception message


def test_malformed_frame_is_transient(emu: EmulatorClient, clients: Client) -> None:
    emu.script("bad", [{"fault": "malformed", "after": 2}])
    _, final = run_stream(clients(), "bad")
    assert code_of(final) == ("transient", "malformed_stream")


@pytest.mark.parametrize(("status", "message", "expected"), [
    (429, "Too many tokens, please wait before trying again.", ("transient", "rate_limited")),
    (503, None, ("transient", "provider_error")),
    (400, "The model returned the following errors: prompt is too long",
     ("context_overflow", "context_overflow")),
    (400, None, ("final", "bad_request")),
    (404, None, ("final", "not_found")),
])
def test_status_before_the_stream(emu: EmulatorClient, clients: Client, status: int,
                                  message: str | None, expected: tuple[str, str]) -> None:
    emu.script("slow", [{"fault": "status", "status": status, "retry_after": 3,
                         "message": message}])
    out, final = run_stream(clients(), "slow")
    assert code_of(final) == expected and final.error is not None
    assert (final.error.status, final.error.retry_after_s) == (status, 3.0)
    assert out.chunks == [] and len(emu.log("slow")) == 1  # no SDK retry


def test_access_denied_falls_back_to_converse(emu: EmulatorClient, clients: Client) -> None:
    emu.script("iam", [{"fault": "access_denied"},
                       {"text": "From converse.", "reasoning": "thought",
                        "tool_call": {"name": "f", "arguments": {"x": 1}}}])
    client = clients()
    with pytest.raises(botocore.exceptions.ClientError) as info:
        stream_converse(client, request("iam"), RecordingOutput())
    assert is_streaming_denied(info.value)
    assert classify_bedrock(info.value).code == "streaming_unsupported"
    emu.script("iam", [{"fault": "access_denied"},
                       {"text": "From converse.", "reasoning": "thought",
                        "tool_call": {"name": "f", "arguments": {"x": 1}}}])
    out = RecordingOutput()
    final = ADAPTER.run(client, request("iam"), out, AttemptSettings(), ())
    assert final.ok and final.streaming_denied is True
    assert final.finish_reason == "tool_calls"
    assert final.usage is not None and final.usage["total_tokens"] > 0
    assert out.deltas[0][0] == "notice" and "InvokeModelWithResponseStream" in out.deltas[0][1]
    assert out.text == "From converse." and out.reasoning == "thought"
    assert out.tool_calls()[0]["name"] == "f" and out.tool_calls()[0]["arguments"] == '{"x":1}'
    assert [(r["path"].rsplit("/", 1)[1], r["status"]) for r in emu.log("iam")] == [
        ("converse-stream", 403), ("converse-stream", 403), ("converse", 200)]


def test_other_errors_are_not_streaming_denials(emu: EmulatorClient, clients: Client) -> None:
    emu.script("deny", [{"fault": "status", "status": 403}, {"fault": "error_event"}])
    client = clients()
    with pytest.raises(botocore.exceptions.ClientError) as info:
        client.converse(**request("deny"))  # AccessDenied, but not on the streaming action
    assert not is_streaming_denied(info.value)
    stream = client.converse_stream(**request("deny"))["stream"]
    with pytest.raises(botocore.exceptions.EventStreamError) as stream_info:
        for _ in stream:
            pass
    stream.close()
    assert not is_streaming_denied(stream_info.value)


def test_complete_converse_whole_body_faults(emu: EmulatorClient, clients: Client) -> None:
    emu.script("w", [{"fault": "no_finish", "text": "whole"}, {"fault": "malformed"},
                     {"fault": "error_event", "error_type": "throttlingException"}])
    client = clients()
    out = RecordingOutput()
    final = complete_converse(client, request("w"), out)
    assert final.ok and final.finish_reason == "stop" and out.text == "whole"
    final = complete_converse(client, request("w"), RecordingOutput())
    assert code_of(final) == ("transient", "empty_response")
    with pytest.raises(botocore.exceptions.ClientError) as info:
        complete_converse(client, request("w"), RecordingOutput())
    assert classify_bedrock(info.value).error_class == "transient"


def test_settings_can_skip_streaming(emu: EmulatorClient, clients: Client) -> None:
    emu.script("plain", [{"text": "not streamed"}])
    out = RecordingOutput()
    final = ADAPTER.run(clients(), request("plain"), out, AttemptSettings(streaming=False), ())
    assert final.ok and not final.streaming_denied and out.text == "not streamed"
    assert emu.log("plain")[0]["stream"] is False


def test_dummy_credentials_need_an_endpoint() -> None:
    with pytest.raises(ValueError, match="endpoint_url"):
        make_client({"name": "p", "aws_credentials": "dummy", "region": "us-east-1"})
    with pytest.raises(ValueError, match="chain"):
        make_client({"name": "p", "aws_credentials": "env", "endpoint_url": "http://127.0.0.1:1"})


# ---- what botocore's read timeout does inside the event loop (measured) -----------

def test_read_timeout_does_fire_on_a_silent_event_stream(emu: EmulatorClient,
                                                         clients: Client) -> None:
    emu.script("wedged", [{"fault": "stall", "after": 3, "stall_s": 2.0}])
    began = time.monotonic()
    out, final = run_stream(clients(read_timeout_s=0.5), "wedged")
    waited = time.monotonic() - began
    assert 0.4 < waited < 1.8  # the socket timeout, not the end of the stall
    assert code_of(final) == ("transient", "read_timeout")
    assert len(out.chunks) == 3


@pytest.mark.slow
def test_frames_boto3_drops_keep_the_socket_alive_without_events(
    emu: EmulatorClient, clients: Client
) -> None:
    # A server trickling frames boto3 parses to nothing (here: an unknown event type every
    # 0.2 s) defeats the read timeout: no exception, yet no event for 1.2 s. Only the
    # supervisor's stale watchdog sees that silence.
    emu.script("trickle", [{"fault": "keepalive", "after": 3, "stall_s": 1.2,
                            "keepalive_every_s": 0.2}])
    out, final = run_stream(clients(read_timeout_s=0.5), "trickle")
    gaps = [b - a for a, b in itertools.pairwise(out.chunk_times)]
    assert final.ok and max(gaps) >= 1.1
    assert emu.log("trickle")[0]["keepalives_sent"] >= 5
