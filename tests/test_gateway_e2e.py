"""Issue 15, item 1: the unmodified `openai` and `anthropic` SDKs, with only
`base_url` and the key changed, against the gateway of a real daemon, with
the emulator's scripted faults behind it. Each SDK call returns or raises
what the same SDK would against a healthy provider, and the emulator's own
record shows what the daemon did underneath (a kill and a retry)."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import time
import urllib.request
from typing import Any

import anthropic
import openai
import pytest
from anthropic.types import MessageParam
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from streamfence.devtools.emulator.control import EmulatorClient
from tests.http_gateway import Gateway

QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]
CLAUDE_QUESTION: list[MessageParam] = [{"role": "user", "content": "hello"}]


def _openai_text(stream: Any) -> tuple[str, str | None, Any]:
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish, usage


def test_openai_streams_the_providers_text_exactly(gateway: Gateway, emu: EmulatorClient) -> None:
    emu.script("clean", [{"fault": "ok", "chunks": 12}])
    stream = gateway.openai().chat.completions.create(
        model="oa/gpt-emu#clean", messages=QUESTION, stream=True,
        stream_options={"include_usage": True})
    text, finish, usage = _openai_text(stream)
    sent = emu.log("clean")
    assert len(sent) == 1 and text == sent[0]["text"], (text, sent)
    assert finish == "stop"
    assert usage is not None and usage.completion_tokens > 0


def test_openai_not_streaming(gateway: Gateway, emu: EmulatorClient) -> None:
    emu.script("whole", [{"fault": "ok"}])
    reply = gateway.openai().chat.completions.create(
        model="oa/gpt-emu#whole", messages=QUESTION)
    assert reply.choices[0].message.content == emu.log("whole")[0]["text"]
    assert reply.choices[0].finish_reason == "stop"


def test_a_zombie_stream_is_killed_and_retried_unseen(gateway: Gateway,
                                                      emu: EmulatorClient) -> None:
    emu.script("zombie", [{"fault": "stall", "after": 0, "stall_s": 4.0}, {"fault": "ok"}])
    text, finish, _ = _openai_text(gateway.openai().chat.completions.create(
        model="oa/gpt-emu#zombie", messages=QUESTION, stream=True))
    sent = emu.log("zombie")
    assert len(sent) == 2, sent  # the stalled request, then the retry
    assert sent[0]["fault"] == "stall" and text == sent[1]["text"]
    assert finish == "stop"


def test_a_429_is_retried_after_its_retry_after(gateway: Gateway, emu: EmulatorClient) -> None:
    emu.script("limited", [{"fault": "status", "status": 429, "retry_after": "1"},
                           {"fault": "ok"}])
    text, _, _ = _openai_text(gateway.openai().chat.completions.create(
        model="oa/gpt-emu#limited", messages=QUESTION, stream=True))
    sent = emu.log("limited")
    assert [r["fault"] for r in sent] == ["status", "ok"] and text == sent[1]["text"]


def test_a_4xx_raises_the_sdks_own_exception(gateway: Gateway, emu: EmulatorClient) -> None:
    emu.script("bad", [{"fault": "status", "status": 400, "message": "no such thing"}])
    with pytest.raises(openai.BadRequestError):
        _openai_text(gateway.openai().chat.completions.create(
            model="oa/gpt-emu#bad", messages=QUESTION, stream=True))
    assert len(emu.log("bad")) == 1  # a 4xx is final: no retry


def test_a_wrong_key_is_refused(gateway: Gateway) -> None:
    with pytest.raises(openai.AuthenticationError):
        gateway.openai(key="sf-local." + "0" * 64).chat.completions.create(
            model="oa/gpt-emu#x", messages=QUESTION)


def _refused_counts(gateway: Gateway) -> dict[str, float]:
    with urllib.request.urlopen(gateway.url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("streamfence_gateway_refused_total{")}


def test_what_the_gateway_refuses_itself_is_answered_and_counted(gateway: Gateway) -> None:
    """Bad bodies (one nested past the JSON parser's depth: it was a 500) and
    an unknown profile: a 4xx naming the problem, each counted on /metrics."""
    before = _refused_counts(gateway)
    bodies = {"not json": b"{", "too deep": b"[" * 100_000,
              "no model": b"[1]", "no route": b'{"model": "m", "messages": []}'}
    answers = {}
    for name, body in bodies.items():
        request = urllib.request.Request(
            gateway.url + "/v1/chat/completions", data=body, method="POST",
            headers={"Authorization": f"Bearer {gateway.key}",
                     "Content-Type": "application/json", "X-Streamfence-Profile": "zz"})
        try:
            urllib.request.urlopen(request, timeout=10).close()
        except urllib.error.HTTPError as reply:
            with reply:
                answers[name] = (reply.code, json.loads(reply.read())["error"]["code"])
    assert answers == {"not json": (400, "bad_message"), "too deep": (400, "bad_message"),
                       "no model": (400, "bad_message"),
                       "no route": (404, "model_not_found")}, answers
    after = _refused_counts(gateway)
    assert after.get("bad_message", 0) - before.get("bad_message", 0) == 3, (before, after)
    assert after.get("unknown_provider", 0) - before.get("unknown_provider", 0) == 1


def test_anthropic_streams_and_answers_whole(gateway: Gateway, emu: EmulatorClient) -> None:
    emu.script("claude", [{"fault": "ok", "chunks": 10}])
    client = gateway.anthropic()
    with client.messages.stream(model="an/claude-emu#claude", max_tokens=200,
                                messages=CLAUDE_QUESTION) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == emu.log("claude")[0]["text"]
    assert final.stop_reason == "end_turn"
    emu.script("claude-whole", [{"fault": "ok"}])
    whole = client.messages.create(model="an/claude-emu#claude-whole", max_tokens=200,
                                   messages=CLAUDE_QUESTION)
    assert whole.content[0].text == emu.log("claude-whole")[0]["text"]  # type: ignore[union-attr]


def test_models_lists_what_may_be_called(gateway: Gateway) -> None:
    request = urllib.request.Request(gateway.url + "/v1/models",
                                     headers={"Authorization": f"Bearer {gateway.key}"})
    with urllib.request.urlopen(request, timeout=5.0) as reply:
        listed = json.load(reply)
    assert {m["id"] for m in listed["data"]} == {"an/*", "br/*", "oa/*"}


# ---- raw SSE: reconnect, abandon ------------------------------------------------------

def _open_stream(gateway: Gateway, key: str, headers: dict[str, str]) -> Any:
    """A raw streaming POST to /v1/chat/completions; the response, headers read."""
    conn = http.client.HTTPConnection(gateway.url.removeprefix("http://"), timeout=30.0)
    body = json.dumps({"model": f"oa/gpt-emu#{key}", "messages": QUESTION, "stream": True})
    conn.request("POST", "/v1/chat/completions", body, {
        "Authorization": f"Bearer {gateway.key}", "Content-Type": "application/json",
        **headers})
    reply = conn.getresponse()
    assert reply.status == 200, reply.read()
    return conn, reply


def _frames(reply: Any, limit: int | None = None) -> list[tuple[int, str]]:
    """(id, data) of each SSE frame of `reply` (a response, or the bytes a
    client printed), up to `limit` frames or the stream's end."""
    lines = iter(reply.splitlines(keepends=True)) if isinstance(reply, bytes) else \
        iter(reply.readline, b"")
    frames: list[tuple[int, str]] = []
    seq, data = -1, None
    while limit is None or len(frames) < limit:
        line = next(lines, b"").decode()
        if not line:
            break
        line = line.rstrip("\n")
        if line.startswith("id: "):
            seq = int(line[4:])
        elif line.startswith("data: "):
            data = line[6:]
        elif line == "" and data is not None:
            frames.append((seq, data))
            data = None
    return frames


def _content(frames: list[tuple[int, str]]) -> str:
    return "".join(choice["delta"].get("content") or ""
                   for _, data in frames if data != "[DONE]"
                   for choice in json.loads(data)["choices"])


def test_a_reconnect_with_last_event_id_gets_exactly_the_rest(gateway: Gateway,
                                                             emu: EmulatorClient) -> None:
    emu.script("resume", [{"fault": "ok", "chunks": 20, "chunk_delay_s": 0.05}])
    headers = {"Idempotency-Key": "resume-1"}
    conn, reply = _open_stream(gateway, "resume", headers)
    first = _frames(reply, limit=5)
    conn.close()  # the connection drops mid-answer; the call runs on (an Idempotency-Key)
    last = first[-1][0]
    conn, reply = _open_stream(gateway, "resume", dict(headers, **{"Last-Event-ID": str(last)}))
    rest = _frames(reply)
    conn.close()
    assert rest and all(seq > last for seq, _ in rest), rest[:3]
    assert rest[-1][1] == "[DONE]"
    ids = [seq for seq, data in first + rest if data != "[DONE]"]
    assert ids == sorted(set(ids)), ids  # no repeat
    sent = emu.log("resume")
    assert len(sent) == 1 and _content(first) + _content(rest) == sent[0]["text"]


def _http_chunks(gateway: Gateway, key: str, headers: dict[str, str]) -> list[bytes]:
    """A streaming POST on a raw socket: the body's chunks of the chunked
    encoding as they were framed (each one write of the gateway), to the end."""
    body = json.dumps({"model": f"oa/gpt-emu#{key}", "messages": QUESTION,
                       "stream": True}).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in {
        "Host": "gateway", "Authorization": f"Bearer {gateway.key}",
        "Content-Type": "application/json", "Content-Length": str(len(body)),
        **headers}.items())
    with socket.create_connection(("127.0.0.1", int(gateway.url.rsplit(":", 1)[1])),
                                  timeout=30.0) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\n{head}\r\n".encode() + body)
        reply = sock.makefile("rb")
        assert b" 200 " in reply.readline()
        while reply.readline() not in (b"\r\n", b""):
            pass
        chunks = []
        while size := int(reply.readline().split(b";")[0], 16):
            chunks.append(reply.read(size))
            assert reply.read(2) == b"\r\n"
    return chunks


def test_events_that_came_together_go_out_in_one_write(gateway: Gateway,
                                                       emu: EmulatorClient) -> None:
    """Issue 32: a call read again from seq 1 (its Idempotency-Key again, the
    call ended) comes from the daemon in a few messages, and the gateway
    writes each batch of events at once (one HTTP chunk, one read for the
    client), the done's frames with the response's end: the same frames
    as the live stream, in far fewer chunks than frames."""
    emu.script("batched", [{"fault": "ok", "chunks": 40}])
    headers = {"Idempotency-Key": "batched-1"}
    live = _http_chunks(gateway, "batched", headers)
    again = _http_chunks(gateway, "batched", headers)
    frames, live_frames = _frames(b"".join(again)), _frames(b"".join(live))
    assert [seq for seq, _ in frames] == [seq for seq, _ in live_frames]
    assert frames[-1][1] == "[DONE]"
    assert _content(frames) == _content(live_frames) == emu.log("batched")[0]["text"]
    assert len(again) < len(frames) / 4, (len(again), len(frames))


def test_a_client_that_goes_away_cancels_its_call(gateway: Gateway,
                                                   emu: EmulatorClient) -> None:
    emu.script("abandoned", [{"fault": "ok", "chunks": 200, "chunk_delay_s": 0.05}])
    conn, reply = _open_stream(gateway, "abandoned", {})
    call_id = reply.getheader("X-Streamfence-Call-Id")
    assert _frames(reply, limit=2)
    conn.close()
    closed = time.time()
    record = emu.wait_for(lambda log: log[0] if log and log[0]["aborted"] else None,
                          timeout=10.0, what="the provider connection to close",
                          key="abandoned")
    assert record["ended"] - closed < 1.0, record["ended"] - closed
    assert not record["completed"]
    with gateway.daemon.client() as client:
        done = client.result(call_id, wait_s=10.0)
    assert done is not None and done["status"] == "cancelled", done


def test_a_providers_status_reaches_the_sdk(gateway: Gateway, emu: EmulatorClient) -> None:
    """A provider's 403 (or 404) raises the exception the SDK raises for it."""
    emu.script("denied", [{"fault": "status", "status": 403, "message": "no access"}])
    with pytest.raises(openai.PermissionDeniedError):
        gateway.openai().chat.completions.create(
            model="oa/gpt-emu#denied", messages=QUESTION)
    emu.script("missing", [{"fault": "status", "status": 404, "message": "no model"}])
    with pytest.raises(anthropic.NotFoundError):
        gateway.anthropic().messages.create(model="an/claude-emu#missing", max_tokens=10,
                                            messages=CLAUDE_QUESTION)


def test_a_cut_after_text_ends_with_the_providers_length_ending(gateway: Gateway,
                                                                emu: EmulatorClient) -> None:
    emu.script("cut", [{"fault": "disconnect", "after": 4, "chunks": 12}])
    text, finish, _ = _openai_text(gateway.openai().chat.completions.create(
        model="oa/gpt-emu#cut", messages=QUESTION, stream=True))
    sent = emu.log("cut")
    assert len(sent) == 1 and text and text == sent[0]["sent_text"], (text, sent)
    assert finish == "length"  # partial: never a retry that would repeat the text
    emu.script("cut-claude", [{"fault": "disconnect", "after": 4, "chunks": 12}])
    with gateway.anthropic().messages.stream(model="an/claude-emu#cut-claude", max_tokens=100,
                                             messages=CLAUDE_QUESTION) as stream:
        claude_text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert claude_text == emu.log("cut-claude")[0]["sent_text"] and claude_text
    assert final.stop_reason == "max_tokens"


def test_a_malformed_chunk_is_retried_unseen(gateway: Gateway, emu: EmulatorClient) -> None:
    emu.script("garbled", [{"fault": "malformed", "after": 0}, {"fault": "ok"}])
    with gateway.anthropic().messages.stream(model="an/claude-emu#garbled", max_tokens=100,
                                             messages=CLAUDE_QUESTION) as stream:
        text = "".join(stream.text_stream)
    sent = emu.log("garbled")
    assert [r["fault"] for r in sent] == ["malformed", "ok"] and text == sent[1]["text"]


def test_tool_calls_are_assembled_by_each_sdk(gateway: Gateway, emu: EmulatorClient) -> None:
    call = {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}
    tools: list[ChatCompletionToolParam] = [{"type": "function", "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    emu.script("tool", [{"fault": "ok", "tool_call": call}])
    slots: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in gateway.openai().chat.completions.create(
            model="oa/gpt-emu#tool", messages=QUESTION, stream=True,
            tools=tools):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for tc in choice.delta.tool_calls or []:
                slot = slots.setdefault(tc.index, {"name": "", "arguments": ""})
                slot["name"] += (tc.function and tc.function.name) or ""
                slot["arguments"] += (tc.function and tc.function.arguments) or ""
    assert slots == {0: call} and finish == "tool_calls"
    emu.script("tool-claude", [{"fault": "ok", "tool_call": call}])
    with gateway.anthropic().messages.stream(
            model="an/claude-emu#tool-claude", max_tokens=100, messages=CLAUDE_QUESTION,
            tools=[{"name": "get_weather", "input_schema": {"type": "object"}}]) as stream:
        final = stream.get_final_message()
    uses = [block for block in final.content if block.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [("get_weather", json.loads(call["arguments"]))]
    assert final.stop_reason == "tool_use"


def test_curl_is_a_client(gateway: Gateway, emu: EmulatorClient) -> None:
    """The README's curl example, as a shell user runs it."""
    emu.script("curl", [{"fault": "ok", "chunks": 6}])
    body = json.dumps({"model": "oa/gpt-emu#curl", "stream": True, "messages": QUESTION})
    done = subprocess.run(
        ["curl", "-sN", gateway.url + "/v1/chat/completions", "-H",
         f"Authorization: Bearer {gateway.key}", "-H", "Content-Type: application/json",
         "-d", body], capture_output=True, timeout=30, check=True)
    frames = _frames(done.stdout)
    assert frames[-1][1] == "[DONE]"
    assert _content(frames) == emu.log("curl")[0]["text"]
