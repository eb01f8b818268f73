"""The gateway's wire renderers (gateway/openai_chat.py, anthropic_messages.py,
http_errors.py) against the real, unmodified `openai` and `anthropic` SDKs.

A real aiohttp server on 127.0.0.1 answers POST /v1/chat/completions and
/v1/messages with the bytes the renderers produce for a scripted list of
daemon events (built by hand as the daemon sends them, PROTOCOL §6), the way
the gateway serves them: the response starts at the first byte a renderer
produces, and a call that ends failed or cancelled before that is the
provider's HTTP error. The SDKs only get `base_url` and a key.
"""

from __future__ import annotations

import asyncio
import http.client
import threading
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import openai
import orjson
import pytest
from aiohttp import web

from streamfence.gateway import anthropic_messages, http_errors, openai_chat
from streamfence.protocol.errors import ErrorCode

CALL_ID = "0123456789abcdef0123456789abcdef"
CREATED = 1_760_000_000
MODEL = "gpt-test"
OPENAI_USAGE = {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19,
                "prompt_tokens_details": {"cached_tokens": 4}}
ANTHROPIC_USAGE = {"input_tokens": 10, "output_tokens": 7, "cache_read_input_tokens": 2,
                   "cache_creation_input_tokens": 0, "prompt_tokens": 12,
                   "completion_tokens": 7, "total_tokens": 19}
WEATHER = [("tool_call", {"index": 0, "id": "call_w", "name": "get_weather",
                          "arguments": '{"city": '}),
           ("tool_call", {"index": 0, "id": None, "name": None, "arguments": '"Paris"}'}),
           ("tool_call", {"index": 1, "id": "call_t", "name": "get_time", "arguments": ""}),
           ("tool_call", {"index": 1, "id": None, "name": None, "arguments": '{"tz": "CET"}'})]
ENDED = ("failed", "cancelled")


# ---- scripted calls ----------------------------------------------------------------------

class Call:
    """A call's events as the daemon publishes them: seq 1, 2, 3 …; the done's
    response is the last attempt's content, assembled as the sink does."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def _add(self, event: dict[str, Any]) -> Call:
        self.events.append({"v": 1, "call_id": CALL_ID, "seq": len(self.events) + 1, **event})
        return self

    def delta(self, kind: str, data: Any, attempt: int = 1) -> Call:
        return self._add({"op": "delta", "attempt": attempt, "kind": kind, "data": data})

    def deltas(self, pairs: list[tuple[str, Any]], attempt: int = 1) -> Call:
        for kind, data in pairs:
            self.delta(kind, data, attempt)
        return self

    def reset(self, attempt: int) -> Call:
        return self._add({"op": "reset", "attempt": attempt})

    def done(self, status: str = "completed", finish_reason: str | None = "stop",
             usage: dict[str, Any] | None = None, error: dict[str, Any] | None = None
             ) -> Call:
        deltas = [e for e in self.events if e["op"] == "delta"]
        last = deltas[-1]["attempt"] if deltas else 1
        mine = [e for e in deltas if e["attempt"] == last]
        slots: dict[int, dict[str, Any]] = {}
        for d in (e["data"] for e in mine if e["kind"] == "tool_call"):
            s = slots.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
            s["id"] = s["id"] or d["id"]
            s["name"] = s["name"] or d["name"]
            s["arguments"] += d["arguments"] or ""

        def joined(kind: str) -> str:
            return "".join(e["data"] for e in mine if e["kind"] == kind)

        response = {"content": joined("text"), "reasoning": joined("reasoning"),
                    "tool_calls": [slots[i] for i in sorted(slots)],
                    "refusal": joined("refusal") or None,
                    "finish_reason": "length" if status == "partial" else finish_reason,
                    "usage": usage, "model": "upstream-model",
                    "provider_response_id": "resp_1", "partial": status == "partial",
                    "dropped_tool_names": [], "content_omitted": False}
        return self._add({"op": "done", "status": status, "response": response,
                          "error": error, "attempts": last})

    def failed(self, code: str, message: str = "it failed", status: str = "failed",
               **extra: Any) -> Call:
        return self.done(status, None, None, {"code": code, "message": message, **extra})


# ---- the server --------------------------------------------------------------------------

Renderer = openai_chat.ChatCompletionStream | anthropic_messages.MessageStream
ErrorFn = Callable[[str, str, http_errors.ProviderError | None], tuple[int, dict[str, Any]]]


class WireServer:
    """aiohttp on its own loop in a thread; every POST answers `self.events`."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.runner: web.AppRunner | None = None
        self.port = 0

    def __enter__(self) -> WireServer:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/messages", self._messages)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return self._whole(openai_chat.completion, http_errors.openai_error, body["model"])
        usage = (body.get("stream_options") or {}).get("include_usage") is True
        renderer = openai_chat.ChatCompletionStream(CALL_ID, body["model"], usage, CREATED)
        return await self._stream(request, renderer, http_errors.openai_error)

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return self._whole(anthropic_messages.message, http_errors.anthropic_error,
                               body["model"])
        renderer = anthropic_messages.MessageStream(CALL_ID, body["model"], CREATED)
        return await self._stream(request, renderer, http_errors.anthropic_error)

    def _whole(self, render: Callable[..., dict[str, Any]], error: ErrorFn,
               model: str) -> web.Response:
        done = self.events[-1]
        if done["status"] in ENDED:
            return _error_response(error, done)
        return web.json_response(render(CALL_ID, model, done, CREATED))

    async def _stream(self, request: web.Request, renderer: Renderer,
                      error: ErrorFn) -> web.StreamResponse:
        response: web.StreamResponse | None = None
        for event in self.events:
            if not renderer.started and event["op"] == "done" and event["status"] in ENDED:
                return _error_response(error, event)
            data = renderer.feed(event)
            if data and response is None:
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await response.prepare(request)
            if data and response is not None:
                await response.write(data)
        assert response is not None, "the script produced no bytes"
        await response.write_eof()
        return response


def _error_response(error: ErrorFn, done: dict[str, Any]) -> web.Response:
    code, message, provider = http_errors.done_error(done)
    status, body = error(code, message, provider)
    return web.json_response(body, status=status)


@pytest.fixture(scope="module")
def server() -> Iterator[WireServer]:
    with WireServer() as srv:
        yield srv


@pytest.fixture(scope="module")  # a client takes ~0.3 s to make (its SSL context)
def oai(server: WireServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def ant(server: WireServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0) as client:
        yield client


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                  "content": "hi"}], **kwargs)


def _message(client: anthropic.Anthropic, **kwargs: Any) -> Any:
    return client.messages.create(model=MODEL, max_tokens=100,
                                  messages=[{"role": "user", "content": "hi"}], **kwargs)


def _raw_frames(server: WireServer, path: str, body: dict[str, Any]) -> list[dict[str, str]]:
    """POST and split the raw SSE body into frames: {field: value}."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        conn.request("POST", path, orjson.dumps(body), {"Content-Type": "application/json"})
        raw = conn.getresponse().read().decode()
    finally:
        conn.close()
    assert raw.endswith("\n\n")
    frames = []
    for block in raw[:-2].split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        assert set(fields) <= {"event", "id", "data"} and "data" in fields, block
        frames.append(fields)
    return frames


# ---- OpenAI: streams ---------------------------------------------------------------------

TEXT = ["Hel", "lo, ", "wörld ✓", " \n", "done."]


def test_openai_stream_text_usage_and_shape(server: WireServer, oai: openai.OpenAI) -> None:
    server.events = (Call().delta("notice", "reconnected").delta("reasoning", "hmm")
                     .deltas([("text", t) for t in TEXT]).done(usage=OPENAI_USAGE).events)
    chunks = list(_chat(oai, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "".join(TEXT)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {(c.id, c.model, c.created, c.object) for c in chunks} == {
        (f"chatcmpl-{CALL_ID}", MODEL, CREATED, "chat.completion.chunk")}
    final, usage = chunks[-2], chunks[-1]
    assert final.choices[0].finish_reason == "stop" and final.choices[0].delta.content is None
    assert usage.choices == [] and usage.usage is not None
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens,
            usage.usage.total_tokens) == (12, 7, 19)
    assert usage.usage.prompt_tokens_details.cached_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])


def test_openai_stream_without_usage_has_no_usage_chunk(server: WireServer,
                                                        oai: openai.OpenAI) -> None:
    server.events = Call().delta("text", "Hi").done(usage=OPENAI_USAGE).events
    chunks = list(_chat(oai, stream=True))
    assert [c.choices[0].finish_reason for c in chunks] == [None, "stop"]
    assert all(c.usage is None for c in chunks)


def test_openai_tool_calls_assembled_by_the_sdk(server: WireServer, oai: openai.OpenAI) -> None:
    server.events = (Call().delta("text", "Checking.").deltas(WEATHER)
                     .done(finish_reason="tool_calls", usage=OPENAI_USAGE).events)
    tools: Any = [{"type": "function", "function": {
        "name": name, "strict": True, "parameters": {
            "type": "object", "properties": {arg: {"type": "string"}}, "required": [arg],
            "additionalProperties": False}}} for name, arg in (("get_weather", "city"),
                                                               ("get_time", "tz"))]
    with oai.chat.completions.stream(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                     tools=tools) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    calls = choice.message.tool_calls or []
    assert [(c.id, c.type, c.function.name, c.function.arguments) for c in calls] == [
        ("call_w", "function", "get_weather", '{"city": "Paris"}'),
        ("call_t", "function", "get_time", '{"tz": "CET"}')]
    assert [c.function.parsed_arguments for c in calls] == [{"city": "Paris"}, {"tz": "CET"}]
    # the same stream accumulated by hand, as apps do with create(stream=True)
    slots: dict[int, dict[str, str]] = {}
    for chunk in _chat(oai, stream=True):
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            slot = slots.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            slot["id"] += tc.id or ""
            slot["name"] += (tc.function and tc.function.name) or ""
            slot["arguments"] += (tc.function and tc.function.arguments) or ""
    assert [tuple(s.values()) for _, s in sorted(slots.items())] == [
        ("call_w", "get_weather", '{"city": "Paris"}'), ("call_t", "get_time", '{"tz": "CET"}')]


def test_openai_partial_ends_with_length(server: WireServer, oai: openai.OpenAI) -> None:
    server.events = Call().deltas([("text", t) for t in TEXT[:3]]).done("partial").events
    chunks = list(_chat(oai, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "".join(TEXT[:3])
    assert chunks[-1].choices[0].finish_reason == "length"


def test_openai_failure_after_text_raises_api_error(server: WireServer,
                                                    oai: openai.OpenAI) -> None:
    server.events = (Call().deltas([("text", t) for t in TEXT[:2]])
                     .failed("retries_exhausted", "3 attempt(s) failed; last: 503").events)
    seen: list[str | None] = []
    with pytest.raises(openai.APIError) as info:
        for chunk in _chat(oai, stream=True):
            seen.append(chunk.choices[0].delta.content)
    assert not isinstance(info.value, openai.APIStatusError)  # mid-stream: no status
    assert seen == TEXT[:2]
    assert info.value.message == "3 attempt(s) failed; last: 503"
    assert (info.value.code, info.value.type) == ("retries_exhausted", "server_error")


def test_openai_reset_never_gives_a_second_answer(server: WireServer,
                                                  oai: openai.OpenAI) -> None:
    server.events = (Call().delta("text", "first").reset(2).delta("text", "second", 2)
                     .done().events)
    seen: list[str | None] = []
    with pytest.raises(openai.APIError, match="restarted"):
        for chunk in _chat(oai, stream=True):
            seen.append(chunk.choices[0].delta.content)
    assert seen == ["first"]
    # a new attempt after visible text without a reset is the same second answer
    server.events = Call().delta("text", "first").delta("text", "second", 2).done().events
    with pytest.raises(openai.APIError, match="restarted"):
        list(_chat(oai, stream=True))


def test_openai_retry_before_text_is_invisible(server: WireServer, oai: openai.OpenAI) -> None:
    server.events = (Call().deltas([("reasoning", "let me"), ("text", "\n"), WEATHER[0]])
                     .delta("notice", "The connection dropped …", 3)
                     .deltas([("text", "\n"), ("text", "Hi"), ("text", " there")], 3)
                     .done(usage=OPENAI_USAGE).events)
    chunks = list(_chat(oai, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "\nHi there"
    assert not any(c.choices[0].delta.tool_calls for c in chunks)


def test_openai_refusal_streams_as_refusal(server: WireServer, oai: openai.OpenAI) -> None:
    server.events = (Call().deltas([("refusal", "I can't "), ("refusal", "help with that.")])
                     .done(finish_reason="content_filter").events)
    chunks = list(_chat(oai, stream=True))
    assert "".join(c.choices[0].delta.refusal or "" for c in chunks) == "I can't help with that."
    assert chunks[-1].choices[0].finish_reason == "content_filter"


# ---- OpenAI: whole responses and errors ---------------------------------------------------

def test_openai_non_streaming_completion(server: WireServer, oai: openai.OpenAI) -> None:
    server.events = (Call().delta("reasoning", "hmm").deltas([("text", t) for t in TEXT])
                     .deltas(WEATHER).done(finish_reason="tool_calls", usage=OPENAI_USAGE).events)
    resp = _chat(oai)
    assert isinstance(resp, openai.types.chat.ChatCompletion)
    assert (resp.id, resp.model, resp.created) == (f"chatcmpl-{CALL_ID}", MODEL, CREATED)
    msg = resp.choices[0].message
    assert (msg.role, msg.content, msg.refusal) == ("assistant", "".join(TEXT), None)
    calls = [c for c in msg.tool_calls or [] if c.type == "function"]
    assert [(c.id, c.function.name, c.function.arguments) for c in calls] == [
        ("call_w", "get_weather", '{"city": "Paris"}'), ("call_t", "get_time", '{"tz": "CET"}')]
    assert resp.choices[0].finish_reason == "tool_calls"
    assert resp.usage is not None and resp.usage.total_tokens == 19
    # an Anthropic upstream's usage and stop reason, on the OpenAI wire
    server.events = Call().delta("text", "Hi").done("partial", usage=ANTHROPIC_USAGE).events
    resp = _chat(oai)
    assert resp.choices[0].finish_reason == "length" and resp.choices[0].message.content == "Hi"
    assert resp.usage is not None
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (12, 7)
    assert resp.usage.prompt_tokens_details.cached_tokens == 2


OPENAI_ERRORS = [("bad_message", 400, openai.BadRequestError),
                 ("context_overflow", 400, openai.BadRequestError),
                 ("unauthenticated", 401, openai.AuthenticationError),
                 ("unknown_provider", 404, openai.NotFoundError),
                 ("rate_limited", 429, openai.RateLimitError),
                 ("too_many_calls", 429, openai.RateLimitError),
                 ("overloaded", 503, openai.InternalServerError),
                 ("stream_stalled", 502, openai.InternalServerError),
                 ("deadline_exceeded", 504, openai.InternalServerError),
                 ("provider_error", 400, openai.BadRequestError),
                 ("cancelled", 499, openai.APIStatusError)]


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(("code", "status", "exc"), OPENAI_ERRORS)
def test_openai_failure_before_any_byte_is_the_http_error(
        server: WireServer, oai: openai.OpenAI, stream: bool, code: str, status: int,
        exc: type[openai.APIStatusError]) -> None:
    server.events = (Call().delta("notice", "a notice is not content")
                     .failed(code, f"because {code}",
                             status="cancelled" if code == "cancelled" else "failed").events)
    with pytest.raises(exc) as info:
        list(_chat(oai, stream=True)) if stream else _chat(oai)
    assert info.value.status_code == status
    assert info.value.message.startswith(f"Error code: {status}")
    assert info.value.body == http_errors.openai_error(code, f"because {code}")[1]["error"]


def test_openai_provider_error_keeps_a_known_status(server: WireServer,
                                                    oai: openai.OpenAI) -> None:
    server.events = Call().failed("provider_error", "no access", provider_status=403).events
    with pytest.raises(openai.PermissionDeniedError):
        _chat(oai)


# ---- Anthropic: streams ------------------------------------------------------------------

def test_anthropic_stream_thinking_text_and_tool_use(server: WireServer,
                                                     ant: anthropic.Anthropic) -> None:
    server.events = (Call().deltas([("reasoning", "Let me"), ("reasoning", " think.")])
                     .deltas([("text", t) for t in TEXT]).delta("notice", "n").deltas(WEATHER)
                     .done(finish_reason="tool_calls", usage=ANTHROPIC_USAGE).events)
    with ant.messages.stream(model=MODEL, max_tokens=100,
                             messages=[{"role": "user", "content": "hi"}]) as stream:
        text = "".join(stream.text_stream)
        msg = stream.get_final_message()
    assert text == "".join(TEXT)
    assert (msg.id, msg.model, msg.role) == (f"msg_{CALL_ID}", MODEL, "assistant")
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use", "tool_use"]
    thinking, said, weather, clock = msg.content
    assert thinking.type == "thinking" and thinking.thinking == "Let me think."
    assert said.type == "text" and said.text == "".join(TEXT)
    assert weather.type == "tool_use" and clock.type == "tool_use"
    assert (weather.id, weather.name, weather.input) == ("call_w", "get_weather",
                                                         {"city": "Paris"})
    assert (clock.id, clock.name, clock.input) == ("call_t", "get_time", {"tz": "CET"})
    assert msg.stop_reason == "tool_use"
    assert (msg.usage.input_tokens, msg.usage.output_tokens,
            msg.usage.cache_read_input_tokens) == (10, 7, 2)


def test_anthropic_partial_is_max_tokens(server: WireServer, ant: anthropic.Anthropic) -> None:
    server.events = (Call().deltas([("text", t) for t in TEXT[:3]])
                     .done("partial", usage=OPENAI_USAGE).events)
    with ant.messages.stream(model=MODEL, max_tokens=100,
                             messages=[{"role": "user", "content": "hi"}]) as stream:
        text = "".join(stream.text_stream)
        msg = stream.get_final_message()
    assert text == "".join(TEXT[:3]) and msg.stop_reason == "max_tokens"
    # an OpenAI upstream's usage: input tokens without the cached ones
    assert (msg.usage.input_tokens, msg.usage.cache_read_input_tokens,
            msg.usage.output_tokens) == (8, 4, 7)


def test_anthropic_failure_after_text_raises_api_status_error(
        server: WireServer, ant: anthropic.Anthropic) -> None:
    server.events = (Call().deltas([("text", t) for t in TEXT[:2]])
                     .failed("stream_stalled", "the provider went silent").events)
    seen: list[str | None] = []
    with pytest.raises(anthropic.APIStatusError) as info, ant.messages.stream(
            model=MODEL, max_tokens=100, messages=[{"role": "user", "content": "hi"}]) as stream:
        seen.extend(stream.text_stream)
    assert type(info.value) is anthropic.APIStatusError  # mid-stream: the 200's status
    assert seen == TEXT[:2]
    assert info.value.body == {"type": "error", "error": {
        "type": "api_error", "message": "the provider went silent"}}


def test_anthropic_reset_never_gives_a_second_answer(server: WireServer,
                                                     ant: anthropic.Anthropic) -> None:
    server.events = (Call().delta("text", "first").reset(2).delta("text", "second", 2)
                     .done().events)
    seen: list[str | None] = []
    with pytest.raises(anthropic.APIStatusError, match="restarted"):
        for event in _message(ant, stream=True):
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                seen.append(event.delta.text)
    assert seen == ["first"]


def test_anthropic_retry_before_text_keeps_one_answer(server: WireServer,
                                                      ant: anthropic.Anthropic) -> None:
    server.events = (Call().deltas([("reasoning", "plan A"), ("text", " "), WEATHER[0]])
                     .deltas([("reasoning", "plan B"), ("text", "Answer.")], 2)
                     .done(usage=ANTHROPIC_USAGE).events)
    with ant.messages.stream(model=MODEL, max_tokens=100,
                             messages=[{"role": "user", "content": "hi"}]) as stream:
        text = "".join(stream.text_stream)
        msg = stream.get_final_message()
    assert text == "Answer."
    # the voided attempt's reasoning stays a block of its own; no tool_use, one text
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
            for b in msg.content] == [("thinking", "plan A"), ("thinking", "plan B"),
                                      ("text", "Answer.")]
    assert msg.stop_reason == "end_turn"


def test_anthropic_refusal_is_the_stop_details(server: WireServer,
                                               ant: anthropic.Anthropic) -> None:
    server.events = (Call().delta("refusal", "Not something I can help with.")
                     .done(finish_reason="content_filter", usage=ANTHROPIC_USAGE).events)
    with ant.messages.stream(model=MODEL, max_tokens=100,
                             messages=[{"role": "user", "content": "hi"}]) as stream:
        msg = stream.get_final_message()
    assert msg.stop_reason == "refusal" and msg.content == []
    assert msg.stop_details is not None
    assert msg.stop_details.explanation == "Not something I can help with."
    whole = _message(ant)
    assert whole.stop_reason == "refusal" and whole.stop_details is not None
    assert whole.stop_details.explanation == "Not something I can help with."


# ---- Anthropic: whole responses and errors ------------------------------------------------

def test_anthropic_non_streaming_message(server: WireServer, ant: anthropic.Anthropic) -> None:
    server.events = (Call().delta("reasoning", "hmm").deltas([("text", t) for t in TEXT])
                     .deltas(WEATHER).done(finish_reason="tool_calls",
                                           usage=ANTHROPIC_USAGE).events)
    msg = _message(ant)
    assert isinstance(msg, anthropic.types.Message)
    assert (msg.id, msg.type, msg.role, msg.model) == (f"msg_{CALL_ID}", "message",
                                                       "assistant", MODEL)
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert msg.content[1].type == "text" and msg.content[1].text == "".join(TEXT)
    assert msg.content[2].type == "tool_use" and msg.content[2].input == {"city": "Paris"}
    assert msg.stop_reason == "tool_use" and msg.stop_details is None
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (10, 7)


ANTHROPIC_ERRORS = [("bad_message", 400, anthropic.BadRequestError),
                    ("unauthenticated", 401, anthropic.AuthenticationError),
                    ("unknown_provider", 404, anthropic.NotFoundError),
                    ("too_large", 413, anthropic.ContentTooLargeError),
                    ("rate_limited", 429, anthropic.RateLimitError),
                    ("overloaded", 529, anthropic.OverloadedError),
                    ("shutting_down", 503, anthropic.ServiceUnavailableError),
                    ("retries_exhausted", 502, anthropic.InternalServerError),
                    ("deadline_exceeded", 504, anthropic.GatewayTimeoutError),
                    ("internal", 500, anthropic.InternalServerError),
                    ("cancelled", 499, anthropic.ClientClosedRequestError)]


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(("code", "status", "exc"), ANTHROPIC_ERRORS)
def test_anthropic_failure_before_any_byte_is_the_http_error(
        server: WireServer, ant: anthropic.Anthropic, stream: bool, code: str, status: int,
        exc: type[anthropic.APIStatusError]) -> None:
    server.events = Call().failed(code, f"because {code}",
                                  status="cancelled" if code == "cancelled" else "failed").events
    with pytest.raises(exc) as info:
        list(_message(ant, stream=True)) if stream else _message(ant)
    assert info.value.status_code == status
    assert info.value.body == http_errors.anthropic_error(code, f"because {code}")[1]


def test_an_empty_answer_is_still_a_whole_answer(server: WireServer, oai: openai.OpenAI,
                                                 ant: anthropic.Anthropic) -> None:
    server.events = Call().delta("notice", "n").done(usage=OPENAI_USAGE).events
    chunks = list(_chat(oai, stream=True))
    assert [(c.choices[0].delta.role, c.choices[0].delta.content, c.choices[0].finish_reason)
            for c in chunks] == [("assistant", "", None), (None, None, "stop")]
    with ant.messages.stream(model=MODEL, max_tokens=100,
                             messages=[{"role": "user", "content": "hi"}]) as stream:
        msg = stream.get_final_message()
    assert (msg.content, msg.stop_reason, msg.usage.output_tokens) == ([], "end_turn", 7)


# ---- the raw frames: ids are the events' seqs ---------------------------------------------

def _script() -> Call:
    return (Call().delta("notice", "n").delta("reasoning", "r1").delta("text", " ")
            .delta("text", "A").delta("text", "B").deltas(WEATHER)
            .done(finish_reason="tool_calls", usage=ANTHROPIC_USAGE))


def test_openai_frame_ids_are_the_event_seqs(server: WireServer) -> None:
    call = _script()
    server.events = call.events
    frames = _raw_frames(server, "/v1/chat/completions", {
        "model": MODEL, "messages": [], "stream": True,
        "stream_options": {"include_usage": True}})
    assert all("event" not in f for f in frames)
    # " " waits for the attempt's first visible text (seq 4) and goes out with it
    done_seq = call.events[-1]["seq"]
    contents = [(int(f["id"]), orjson.loads(f["data"])["choices"][0]["delta"].get("content"))
                for f in frames[:2]]
    assert contents == [(4, " "), (4, "A")]
    assert [int(f["id"]) for f in frames] == [4, 4, 5] + [done_seq] * (len(frames) - 3)
    assert frames[-1]["data"] == "[DONE]"


def test_anthropic_frame_ids_are_the_event_seqs(server: WireServer) -> None:
    call = _script()
    server.events = call.events
    frames = _raw_frames(server, "/v1/messages", {"model": MODEL, "messages": [],
                                                  "max_tokens": 5, "stream": True})
    for f in frames:
        assert orjson.loads(f["data"])["type"] == f["event"]
    done_seq = call.events[-1]["seq"]
    assert [(f["event"], int(f["id"])) for f in frames[:7]] == [
        ("message_start", 2), ("content_block_start", 2), ("content_block_delta", 2),
        ("content_block_stop", 4), ("content_block_start", 4), ("content_block_delta", 4),
        ("content_block_delta", 4)]
    assert [(f["event"], int(f["id"])) for f in frames[7:9]] == [("content_block_delta", 5),
                                                                 ("content_block_stop", done_seq)]
    assert {int(f["id"]) for f in frames[8:]} == {done_seq}
    assert [f["event"] for f in frames[-2:]] == ["message_delta", "message_stop"]


# ---- the table --------------------------------------------------------------------------------

def test_every_protocol_error_code_has_a_row() -> None:
    missing = {c.value for c in ErrorCode} - set(http_errors.ERRORS) - {"provider_error"}
    assert not missing


def test_provider_error_status() -> None:
    given = http_errors.ProviderError
    assert http_errors.openai_error("provider_error", "m", given(404))[0] == 404
    assert http_errors.anthropic_error("provider_error", "m", given(529)) == (
        529, {"type": "error", "error": {"type": "overloaded_error", "message": "m"}})
    assert http_errors.openai_error("provider_error", "m", given(200))[0] == 400
    assert http_errors.openai_error("provider_error", "m")[0] == 400
    assert http_errors.openai_error("no_such_code", "m")[0] == 500


def test_renderers_refuse_events_after_the_done() -> None:
    events = Call().delta("text", "x").done().events
    for renderer in (openai_chat.ChatCompletionStream(CALL_ID, MODEL, False, CREATED),
                     anthropic_messages.MessageStream(CALL_ID, MODEL)):
        assert renderer.feed(events[0]) and renderer.feed(events[1])
        with pytest.raises(ValueError, match="ended"):
            renderer.feed(events[1])


def test_omitted_content_is_refused_not_rendered_empty() -> None:
    done = Call().delta("text", "x").done().events[-1]
    done["response"].update(content="", content_omitted=True)
    with pytest.raises(ValueError, match="omits its content"):
        openai_chat.completion(CALL_ID, MODEL, done)
    with pytest.raises(ValueError, match="omits its content"):
        anthropic_messages.message(CALL_ID, MODEL, done)
