"""The emulator's Anthropic Messages wire, parsed by the real anthropic SDK.

One emulator process serves the module (the ``emulator`` fixture of
conftest.py, started and reaped there); each test resets its scripts and log.
The SDK's own streaming (``messages.create(stream=True)`` and
``messages.stream``) reads the bytes, so the wire is checked against the
parser that production code would use. What the SDK raises for each fault is
asserted here too: it is what the worker's error classification must handle.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx2
import pytest
from anthropic.types import RawMessageStreamEvent

from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess
from streamfence.workers.errors import classify

MESSAGES: list[Any] = [{"role": "user", "content": "Say something deterministic."}]


@pytest.fixture
def client(emulator: EmulatorProcess) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=emulator.base_url, api_key="test-key", max_retries=0,
                             timeout=anthropic.Timeout(10.0, read=5.0)) as c:
        yield c


def events(client: anthropic.Anthropic, key: str, **kwargs: Any) -> list[RawMessageStreamEvent]:
    with client.messages.create(model=f"claude-emu#{key}", max_tokens=256, messages=MESSAGES,
                                stream=True, **kwargs) as stream:
        return list(stream)


def text_of(evs: list[RawMessageStreamEvent]) -> str:
    return "".join(e.delta.text for e in evs
                   if e.type == "content_block_delta" and e.delta.type == "text_delta")


def only(emu: EmulatorClient, key: str) -> dict[str, Any]:
    records = emu.log(key)
    assert len(records) == 1, records
    return records[0]


def test_ok_stream_has_anthropic_event_order(emu: EmulatorClient, client: anthropic.Anthropic) -> None:
    evs = events(client, "ok")
    record = only(emu, "ok")
    assert [e.type for e in evs] == (["message_start", "content_block_start"]
                                     + ["content_block_delta"] * 8
                                     + ["content_block_stop", "message_delta", "message_stop"])
    assert text_of(evs) == record["text"] == record["sent_text"]
    assert len(record["text"].encode()) > len(record["text"])  # multi-byte UTF-8 in there
    start = evs[0]
    assert start.type == "message_start"
    assert start.message.id == f"msg_emu{record['n']}" and start.message.model == "claude-emu"
    assert start.message.content == [] and start.message.stop_reason is None
    assert start.message.usage.input_tokens > 0
    delta = evs[-2]
    assert delta.type == "message_delta"
    assert delta.delta.stop_reason == "end_turn" and delta.usage.output_tokens == 8
    assert record["chunks_sent"] == 13 and record["completed"] and not record["aborted"]
    assert record["auth_present"] is True and record["stream"] is True
    assert record["path"] == "/v1/messages" and record["model"] == "claude-emu"


def test_thinking_text_and_tool_use_through_the_sdk_accumulator(
        emu: EmulatorClient, client: anthropic.Anthropic) -> None:
    emu.script("all", [{"reasoning": True, "text": "Let me check.", "chunks": 4,
                        "tool_call": {"name": "get_weather", "arguments": {"city": "Zürich"}}}])
    with client.messages.stream(model="claude-emu#all", max_tokens=256, messages=MESSAGES) as s:
        raw = [e.type for e in s]
        message = s.get_final_message()
    record = only(emu, "all")
    kinds = [b.type for b in message.content]
    assert kinds == ["thinking", "text", "tool_use"]
    thinking, text, tool = message.content
    assert thinking.type == "thinking" and thinking.thinking == record["reasoning_text"]
    assert thinking.signature  # a signature_delta closed the thinking block
    assert text.type == "text" and text.text == "Let me check." == record["sent_text"]
    assert tool.type == "tool_use" and tool.name == "get_weather"
    assert tool.id == record["tool_call"]["id"] and tool.input == {"city": "Zürich"}
    assert message.stop_reason == "tool_use" and message.usage.output_tokens == 12
    assert raw.count("input_json") == 4 and raw.count("thinking") == 4


def test_refusal_is_a_stop_reason_with_details(emu: EmulatorClient, client: anthropic.Anthropic) -> None:
    emu.script("no", [{"text": "I", "refusal": "Declined (emulated)."}])
    evs = events(client, "no")
    delta = next(e for e in evs if e.type == "message_delta")
    assert delta.delta.stop_reason == "refusal"
    assert delta.delta.stop_details is not None
    assert delta.delta.stop_details.explanation == "Declined (emulated)."
    assert only(emu, "no")["refusal"] == "Declined (emulated)."


def test_non_streaming_message(emu: EmulatorClient, client: anthropic.Anthropic) -> None:
    emu.script("whole", [{"tool_call": {"name": "f", "arguments": {"x": [1, 2]}}, "text": "ok"}])
    message = client.messages.create(model="claude-emu#whole", max_tokens=256, messages=MESSAGES)
    record = only(emu, "whole")
    assert [b.type for b in message.content] == ["text", "tool_use"]
    assert message.content[1].type == "tool_use" and message.content[1].input == {"x": [1, 2]}
    assert message.stop_reason == "tool_use" and record["sent_text"] == "ok"
    assert record["stream"] is False and record["completed"]


@pytest.mark.parametrize(("status", "error", "etype"), [
    (429, anthropic.RateLimitError, "rate_limit_error"),
    (529, anthropic.OverloadedError, "overloaded_error"),
    (500, anthropic.InternalServerError, "api_error"),
    (400, anthropic.BadRequestError, "invalid_request_error"),
])
def test_status_fault_raises_the_sdk_error(emu: EmulatorClient, client: anthropic.Anthropic,
                                           status: int, error: type[anthropic.APIStatusError],
                                           etype: str) -> None:
    emu.script("st", [{"fault": "status", "status": status, "retry_after": 3}])
    with pytest.raises(error) as info:
        events(client, "st")
    err = info.value
    assert err.status_code == status and err.type == etype
    assert isinstance(err.body, dict) and err.body["type"] == "error"
    assert err.response.headers["retry-after"] == "3"
    assert err.request_id == f"req_emu_{only(emu, 'st')['n']}"
    classified = classify(err)
    assert classified.error_class == ("final" if status == 400 else "transient")
    assert classified.retry_after_s == 3.0


def test_error_event_is_an_api_status_error_on_a_200(emu: EmulatorClient,
                                                     client: anthropic.Anthropic) -> None:
    emu.script("evt", [{"fault": "error_event", "after": 3}])
    received: list[RawMessageStreamEvent] = []
    with pytest.raises(anthropic.APIStatusError) as info, client.messages.create(
            model="claude-emu#evt", max_tokens=256, messages=MESSAGES, stream=True) as stream:
        received.extend(stream)
    assert len(received) == 3 == only(emu, "evt")["chunks_sent"]
    assert info.value.status_code == 200 and info.value.type == "overloaded_error"
    assert classify(info.value).error_class == "transient"


def test_disconnect_mid_body_is_a_connection_error(emu: EmulatorClient,
                                                   client: anthropic.Anthropic) -> None:
    """Up to 2.16 the SDK raised httpx2's RemoteProtocolError raw here; 2.17
    wraps it in its APIConnectionError: the classifier gives both one code."""
    emu.script("cut", [{"fault": "disconnect", "after": 4}])
    received: list[RawMessageStreamEvent] = []
    with pytest.raises((httpx2.RemoteProtocolError, anthropic.APIConnectionError)) as info, \
            client.messages.create(model="claude-emu#cut", max_tokens=256, messages=MESSAGES,
                                   stream=True) as stream:
        received.extend(stream)
    cut = info.value
    assert isinstance(cut.__cause__ if isinstance(cut, anthropic.APIConnectionError) else cut,
                      httpx2.RemoteProtocolError), repr(cut)
    assert (classify(cut).error_class, classify(cut).code) == ("transient", "connection_error")
    record = only(emu, "cut")
    assert len(received) == record["chunks_sent"] == 4
    assert text_of(received) == record["sent_text"] and record["aborted"]


def test_malformed_event_raises_json_error(emu: EmulatorClient, client: anthropic.Anthropic) -> None:
    emu.script("bad", [{"fault": "malformed", "after": 2}])
    with pytest.raises(json.JSONDecodeError):
        events(client, "bad")
    assert only(emu, "bad")["chunks_sent"] == 2


def test_no_finish_ends_normally_in_the_sdk(emu: EmulatorClient, client: anthropic.Anthropic) -> None:
    emu.script("nofin", [{"fault": "no_finish"}])
    with client.messages.stream(model="claude-emu#nofin", max_tokens=256, messages=MESSAGES) as s:
        types = [e.type for e in s]
        message = s.get_final_message()
    record = only(emu, "nofin")
    # The SDK reports no error: only the missing message_stop tells the stream was cut.
    assert "message_stop" not in types and "message_delta" not in types
    assert message.stop_reason is None and message.content[0].type == "text"
    assert message.content[0].text == record["text"] == record["sent_text"]
    assert record["chunks_sent"] == 11 and not record["completed"]


def test_empty_stream_has_no_events(emu: EmulatorClient, client: anthropic.Anthropic) -> None:
    emu.script("empty", [{"fault": "empty"}])
    assert events(client, "empty") == []
    record = only(emu, "empty")
    assert record["chunks_sent"] == 0 and record["completed"]


def test_pings_are_keepalives_not_chunks(emu: EmulatorClient, client: anthropic.Anthropic) -> None:
    emu.script("ka", [{"fault": "keepalive", "after": 2, "stall_s": 0.3, "keepalive_every_s": 0.1}])
    start = time.monotonic()
    evs = events(client, "ka")
    assert time.monotonic() - start >= 0.25
    record = only(emu, "ka")
    assert "ping" not in [e.type for e in evs]  # the SDK drops pings
    assert len(evs) == record["chunks_sent"] == 13 and record["keepalives_sent"] >= 3


def test_stall_resumes_on_the_same_connection(emu: EmulatorClient, client: anthropic.Anthropic) -> None:
    emu.script("z", [{"fault": "stall", "after": 3, "stall_s": 0.4}])
    arrivals: list[float] = []
    start = time.monotonic()
    with client.messages.create(model="claude-emu#z", max_tokens=256, messages=MESSAGES,
                                stream=True) as stream:
        for _ in stream:
            arrivals.append(time.monotonic())
    # The 4th event is written 0.4 s after the 3rd, so it cannot arrive sooner after the
    # start (a bound no load can break: a gap between arrivals shrinks if the 3rd is read late).
    assert arrivals[3] - start >= 0.4
    record = only(emu, "z")  # one request: the stream resumed on its connection
    assert record["completed"] and len(arrivals) == record["chunks_sent"]


def test_header_key_and_request_validation(emu: EmulatorClient, client: anthropic.Anthropic) -> None:
    emu.script("hdr", [{"text": "via header"}])
    evs = events(client, "ignored", extra_headers={"X-Emu-Key": "hdr"})
    assert text_of(evs) == "via header"
    request = urllib.request.Request(
        emu.base_url + "/v1/messages",
        data=json.dumps({"model": "claude-emu#novalid", "messages": MESSAGES}).encode(),
        headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=5)
    with info.value as err:
        body = json.loads(err.read())
    assert err.code == 400 and body["type"] == "error"
    assert body["error"] == {"type": "invalid_request_error", "message": "max_tokens: Field required"}
    assert only(emu, "hdr")["auth_present"] is True
    assert emu.log("novalid") == [] and emu.log()[-1]["status"] == 400  # no step consumed
