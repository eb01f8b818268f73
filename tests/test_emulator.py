"""The provider emulator, driven over real HTTP by the real openai SDK.

One emulator process serves the module (started and reaped by the
``emulator`` fixture); each test resets its scripts and log. Waiting is done
by polling the log with deadlines, never by fixed sleeps; stalls are short.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import httpx2
import openai
import pytest
from openai.types.chat import ChatCompletionChunk

from streamfence.devtools.emulator.control import EmulatorClient, EmulatorError, EmulatorProcess
from streamfence.devtools.emulator.script import (
    ScriptError,
    parse_step,
    split_model_key,
    split_text,
)

MESSAGES: list[Any] = [{"role": "user", "content": "Say something deterministic."}]


@pytest.fixture(scope="module")
def emulator() -> Iterator[EmulatorProcess]:
    with EmulatorProcess() as emu:
        yield emu
    assert emu.returncode is not None, "the emulator was not reaped"


@pytest.fixture
def control(emulator: EmulatorProcess) -> EmulatorClient:
    client = emulator.client()
    client.reset()
    return client


@pytest.fixture
def oai(emulator: EmulatorProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=emulator.openai_base_url, api_key="test", max_retries=0, timeout=10.0
    ) as client:
        yield client


def stream(oai: openai.OpenAI, key: str, **kwargs: Any) -> openai.Stream[ChatCompletionChunk]:
    result: openai.Stream[ChatCompletionChunk] = oai.chat.completions.create(
        model=f"gpt-emu#{key}", messages=MESSAGES, stream=True, **kwargs
    )
    return result


def collect(oai: openai.OpenAI, key: str, **kwargs: Any) -> list[ChatCompletionChunk]:
    with stream(oai, key, **kwargs) as s:
        return list(s)


def content(chunks: list[ChatCompletionChunk]) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def only(control: EmulatorClient, key: str) -> dict[str, Any]:
    records = control.log(key)
    assert len(records) == 1, records
    return records[0]


# --- normal responses -------------------------------------------------------


def test_ok_stream_matches_log_and_sends_usage(control: EmulatorClient, oai: openai.OpenAI) -> None:
    chunks = collect(oai, "ok", stream_options={"include_usage": True})

    record = only(control, "ok")
    text = content(chunks)
    assert text == record["text"] == record["sent_text"]
    assert text.startswith(f"Answer {record['n']} for ok: ")
    assert len(text.encode()) > len(text), "the default text should hold multi-byte UTF-8"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * 8 + ["stop"]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 8
    assert usage_chunk.usage.total_tokens == (
        usage_chunk.usage.prompt_tokens + usage_chunk.usage.completion_tokens
    )
    assert {c.model for c in chunks} == {"gpt-emu"}
    assert record["chunks_sent"] == 10  # 8 text + finish + usage
    assert record["completed"] and not record["aborted"]
    assert record["auth_present"] is True
    assert record["stream"] is True and record["model"] == "gpt-emu"
    assert record["stream_options"] == {"include_usage": True}


def test_without_include_usage_there_is_no_usage_chunk(
    control: EmulatorClient, oai: openai.OpenAI
) -> None:
    chunks = collect(oai, "nousage")
    assert all(c.choices for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"
    record = only(control, "nousage")
    assert record["has_stream_options"] is False and record["stream_options"] is None


def test_texts_are_distinct_per_request_and_text_is_split_exactly(
    control: EmulatorClient, oai: openai.OpenAI
) -> None:
    first, second = content(collect(oai, "same")), content(collect(oai, "same"))
    assert first != second

    control.script("exact", [{"text": "héllo wörld 🙂!", "chunks": 3}])
    chunks = collect(oai, "exact")
    pieces = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert pieces == ["héll", "o wör", "ld 🙂!"]


def test_tool_call_streams_over_several_deltas(control: EmulatorClient, oai: openai.OpenAI) -> None:
    control.script(
        "tool",
        [{"tool_call": {"name": "get_weather", "arguments": {"city": "Zürich"}}, "chunks": 4}],
    )
    chunks = collect(oai, "tool")
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 5  # header + 4 argument pieces
    head, rest = calls[0], calls[1:]
    assert head.index == 0 and head.id and head.type == "function"
    assert head.function is not None and head.function.name == "get_weather"
    assert all(tc.id is None and tc.function and tc.function.name is None for tc in rest)
    arguments = "".join(tc.function.arguments or "" for tc in calls if tc.function)
    assert json.loads(arguments) == {"city": "Zürich"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert content(chunks) == ""
    assert only(control, "tool")["tool_call"]["arguments"] == arguments


def test_reasoning_deltas_come_before_the_text(control: EmulatorClient, oai: openai.OpenAI) -> None:
    control.script("think", [{"reasoning": True, "chunks": 4}])
    chunks = collect(oai, "think")
    extras = [(c.choices[0].delta.model_extra or {}) for c in chunks]
    reasoning = [e["reasoning_content"] for e in extras if "reasoning_content" in e]
    assert len(reasoning) == 4
    assert all("reasoning_content" in e for e in extras[:4])
    record = only(control, "think")
    assert "".join(reasoning) == record["reasoning_text"]
    assert content(chunks) == record["text"] == record["sent_text"]


def test_non_streaming_completion(control: EmulatorClient, oai: openai.OpenAI) -> None:
    result = oai.chat.completions.create(model="gpt-emu#whole", messages=MESSAGES)
    record = only(control, "whole")
    assert result.choices[0].message.content == record["text"] == record["sent_text"]
    assert result.choices[0].finish_reason == "stop"
    assert result.usage is not None and result.usage.completion_tokens == 8
    assert record["stream"] is False and record["completed"]


# --- faults --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "error", "retry_after", "message"),
    [
        (429, openai.RateLimitError, "2", None),
        (500, openai.InternalServerError, None, None),
        (503, openai.InternalServerError, "1", None),
        (400, openai.BadRequestError, None, "Unrecognized request argument: stream_options"),
    ],
)
def test_status_fault_raises_the_sdk_error(
    control: EmulatorClient,
    oai: openai.OpenAI,
    status: int,
    error: type[openai.APIStatusError],
    retry_after: str | None,
    message: str | None,
) -> None:
    step: dict[str, Any] = {"fault": "status", "status": status}
    if retry_after is not None:
        step["retry_after"] = int(retry_after)
    if message is not None:
        step["message"] = message
    control.script("status", [step])
    with pytest.raises(error) as info:
        collect(oai, "status")
    err = info.value
    assert err.status_code == status
    assert err.response.headers.get("retry-after") == retry_after
    assert isinstance(err.body, dict) and err.body["message"]
    if message is not None:
        assert err.body["message"] == message
    record = only(control, "status")
    assert record["status"] == status and record["chunks_sent"] == 0


def test_disconnect_raises_connection_error_after_the_scripted_chunks(
    control: EmulatorClient, oai: openai.OpenAI
) -> None:
    control.script("cut", [{"fault": "disconnect", "after": 3}])
    received: list[ChatCompletionChunk] = []
    with pytest.raises(openai.APIConnectionError) as info, stream(oai, "cut") as s:
        for chunk in s:
            received.append(chunk)
    assert isinstance(info.value.__cause__, httpx2.RemoteProtocolError)
    record = only(control, "cut")
    assert len(received) == record["chunks_sent"] == 3
    assert content(received) == record["sent_text"]
    assert record["aborted"] and not record["completed"]


def test_stall_pauses_then_resumes_on_the_same_connection(
    control: EmulatorClient, oai: openai.OpenAI
) -> None:
    control.script("zombie", [{"fault": "stall", "after": 2, "stall_s": 0.8}])
    arrivals: list[float] = []
    chunks: list[ChatCompletionChunk] = []
    start = time.monotonic()
    with stream(oai, "zombie") as s:
        for chunk in s:
            arrivals.append(time.monotonic())
            chunks.append(chunk)
            if len(chunks) == 2:
                stalled = control.wait_for(
                    lambda rs: rs and rs[0]["chunks_sent"] == 2 and not rs[0]["completed"],
                    timeout=0.7,
                    what="the stalled request to show 2 chunks sent",
                    key="zombie",
                )
                assert stalled
    # The silence between chunk 2 and chunk 3: the 3rd cannot arrive sooner after the start
    # (a bound no load can break, unlike a gap, which shrinks if chunk 2 is read late).
    assert arrivals[2] - start >= 0.8, arrivals
    record = only(control, "zombie")  # one request: the stream resumed, no reconnect
    assert len(chunks) == record["chunks_sent"] == 9
    assert content(chunks) == record["text"] == record["sent_text"]
    assert record["completed"] and not record["aborted"]


def test_client_leaving_during_a_stall_marks_the_record_aborted(
    control: EmulatorClient, oai: openai.OpenAI
) -> None:
    control.script("leaver", [{"fault": "stall", "after": 2, "stall_s": 1.0}])
    with stream(oai, "leaver") as s:
        received = [next(s), next(s)]
    records = control.wait_for(
        lambda rs: rs if rs and rs[0]["aborted"] else None,
        timeout=0.9,
        what="the abandoned stall to be marked aborted",
        key="leaver",
    )
    assert records[0]["chunks_sent"] == 2 and not records[0]["completed"]
    assert records[0]["sent_text"] == content(received)


def test_no_finish_ends_without_finish_reason(control: EmulatorClient, oai: openai.OpenAI) -> None:
    control.script("nofin", [{"fault": "no_finish"}])
    chunks = collect(oai, "nofin", stream_options={"include_usage": True})
    assert len(chunks) == 8
    assert all(c.choices and c.choices[0].finish_reason is None for c in chunks)
    record = only(control, "nofin")
    assert content(chunks) == record["text"] == record["sent_text"]
    assert not record["completed"] and not record["aborted"]


def test_malformed_data_raises_json_error(control: EmulatorClient, oai: openai.OpenAI) -> None:
    control.script("bad", [{"fault": "malformed", "after": 2}])
    received: list[ChatCompletionChunk] = []
    with pytest.raises(json.JSONDecodeError), stream(oai, "bad") as s:
        for chunk in s:
            received.append(chunk)
    assert len(received) == only(control, "bad")["chunks_sent"] == 2


def test_error_event_raises_api_error(control: EmulatorClient, oai: openai.OpenAI) -> None:
    control.script("evt", [{"fault": "error_event", "after": 1, "message": "connection lost"}])
    with pytest.raises(openai.APIError, match="connection lost") as info:
        collect(oai, "evt")
    assert not isinstance(info.value, openai.APIStatusError | openai.APIConnectionError)
    assert only(control, "evt")["chunks_sent"] == 1


def test_empty_stream_yields_no_chunks(control: EmulatorClient, oai: openai.OpenAI) -> None:
    control.script("empty", [{"fault": "empty"}])
    assert collect(oai, "empty") == []
    record = only(control, "empty")
    assert record["chunks_sent"] == 0 and record["completed"]


def test_keepalive_comments_are_not_chunks(control: EmulatorClient, oai: openai.OpenAI) -> None:
    control.script(
        "ka", [{"fault": "keepalive", "after": 1, "stall_s": 0.4, "keepalive_every_s": 0.1}]
    )
    start = time.monotonic()
    chunks = collect(oai, "ka")
    assert time.monotonic() - start >= 0.35
    record = only(control, "ka")
    assert len(chunks) == record["chunks_sent"] == 9
    assert record["keepalives_sent"] >= 3
    assert content(chunks) == record["text"]


def test_non_streaming_disconnect_raises_connection_error(
    control: EmulatorClient, oai: openai.OpenAI
) -> None:
    control.script("wholecut", [{"fault": "disconnect"}])
    with pytest.raises(openai.APIConnectionError):
        oai.chat.completions.create(model="gpt-emu#wholecut", messages=MESSAGES)
    assert only(control, "wholecut")["aborted"]


# --- scripting and the log -------------------------------------------------------


def test_scripts_are_consumed_in_order_per_key(control: EmulatorClient, oai: openai.OpenAI) -> None:
    control.script("a", [{"fault": "status", "status": 500}, {"text": "second"}])
    control.script("b", [{"text": "other"}])
    with pytest.raises(openai.InternalServerError):
        collect(oai, "a")
    assert content(collect(oai, "b")) == "other"
    assert content(collect(oai, "a")) == "second"
    assert content(collect(oai, "a")).startswith("Answer ")  # script exhausted: default
    assert [r["fault"] for r in control.log("a")] == ["status", "ok", "ok"]
    assert [r["n"] for r in control.log()] == sorted(r["n"] for r in control.log())


def test_log_tracks_a_slow_stream_as_it_progresses(
    control: EmulatorClient, oai: openai.OpenAI
) -> None:
    control.script("slow", [{"chunks": 6, "chunk_delay_s": 0.1}])
    seen = ""
    with stream(oai, "slow") as s:
        for i, chunk in enumerate(s, start=1):
            seen += chunk.choices[0].delta.content or ""
            record = only(control, "slow")
            assert record["chunks_sent"] >= i
            assert record["sent_text"].startswith(seen)
            if i <= 2:  # at least 0.4 s of the stream is still to come
                assert not record["completed"]
    record = control.wait_for(
        lambda rs: rs[0] if rs[0]["completed"] else None, 2.0, "completion", key="slow"
    )
    assert record["sent_text"] == seen == record["text"]


def test_header_key_and_auth_presence(control: EmulatorClient, oai: openai.OpenAI) -> None:
    control.script("hdr", [{"text": "via header"}])
    chunks = collect(oai, "ignored", extra_headers={"X-Emu-Key": "hdr"})
    assert content(chunks) == "via header"
    request = urllib.request.Request(
        control.base_url + "/v1/chat/completions",
        data=json.dumps({"model": "gpt-emu#anon", "messages": MESSAGES}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        assert json.loads(response.read())["object"] == "chat.completion"
    assert only(control, "hdr")["auth_present"] is True
    assert only(control, "anon")["auth_present"] is False


def test_control_api_rejects_bad_steps(control: EmulatorClient) -> None:
    for bad in ({"fault": "explode"}, {"chunk": 3}, {"after": -1}, {"stall_s": "1"}):
        with pytest.raises(EmulatorError, match="HTTP 400"):
            control.script("bad", [bad])
    assert control.health()["pending_steps"] == {}


def test_wait_for_times_out_with_a_clear_message(control: EmulatorClient) -> None:
    with pytest.raises(EmulatorError, match=r"waiting for the impossible.*no requests"):
        control.wait_for(lambda rs: False, timeout=0.1, what="the impossible")


# --- pure helpers ------------------------------------------------------------------


def test_split_text_and_model_key() -> None:
    assert split_text("abcdefg", 3) == ["ab", "cd", "efg"]
    assert split_text("ab", 5) == ["a", "b"]
    assert split_text("", 3) == []
    assert split_model_key("gpt-emu#k1") == ("gpt-emu", "k1")
    assert split_model_key("gpt-emu") == ("gpt-emu", None)
    assert split_model_key("gpt-emu#k1", "hdr") == ("gpt-emu", "hdr")
    with pytest.raises(ScriptError, match="tool_call"):
        parse_step({"tool_call": {"name": "x"}})


# --- the process ---------------------------------------------------------------------


def test_process_that_fails_to_start_is_reported_and_reaped() -> None:
    emu = EmulatorProcess(extra_args=["--log-limit", "many"], ready_timeout=10.0)
    with pytest.raises(EmulatorError, match=r"exited with status 2 before it was ready"):
        emu.start()
    assert emu.returncode == 2


def test_emulator_exits_when_its_stdin_closes() -> None:
    cmd = [sys.executable, "-m", "streamfence.devtools.emulator", "--port", "0", "--exit-on-stdin-eof"]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().startswith(b"EMULATOR_READY http://127.0.0.1:")
        proc.stdin.close()
        assert proc.wait(timeout=5) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        if proc.stdin is not None:
            proc.stdin.close()
