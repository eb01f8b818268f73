"""Issue 33, item 1: either SDK reaches a profile of any kind. The official
`openai` SDK served by an Anthropic and by a Bedrock profile, the
`anthropic` SDK by an OpenAI and by a Bedrock profile, through the gateway
of a real daemon in front of the emulator, streaming and not, with tools:
a tool call in the answer, then a follow-up carrying the tool result. Each
answer is what the emulator sent (text, tool call, usage), and the
emulator's record of the request is the translated request. A request the
target cannot express is a 400 in the caller's format naming the field,
and nothing reaches the provider."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anthropic
import openai
import pytest
from anthropic.types import MessageParam, ToolParam
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from streamfence.devtools.emulator.control import EmulatorClient
from tests.http_gateway import Gateway

CALL = {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}
SCHEMA: dict[str, Any] = {"type": "object", "properties": {"city": {"type": "string"}}}
OPENAI_TOOLS: list[ChatCompletionToolParam] = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city", "parameters": SCHEMA}}]
ANTHROPIC_TOOLS: list[ToolParam] = [
    {"name": "get_weather", "description": "The weather in a city", "input_schema": SCHEMA}]
# The emulator's usage fields on each wire, as the caller's wire names them.
TO_OPENAI = {"an": ("input_tokens", "output_tokens"), "br": ("inputTokens", "outputTokens")}
TO_ANTHROPIC = {"oa": ("prompt_tokens", "completion_tokens"),
                "br": ("inputTokens", "outputTokens")}


def _sent(emu: EmulatorClient, key: str) -> dict[str, Any]:
    """The emulator's record of the request that answered (the last of its key)."""
    records = emu.log(key)
    assert records, f"nothing reached the emulator for {key}"
    return records[-1]


def _body(record: dict[str, Any]) -> dict[str, Any]:
    """The request as the worker sent it, less what the worker adds to stream."""
    return {k: v for k, v in record["request"].items() if k not in ("stream", "stream_options")}


# ---- the openai SDK served by an Anthropic and a Bedrock profile ---------------------

def _openai_call(gateway: Gateway, model: str, messages: list[ChatCompletionMessageParam],
                 stream: bool) -> tuple[str, list[dict[str, str]], str | None, Any]:
    """(text, tool calls, finish_reason, usage) of one chat completion."""
    with gateway.openai() as client:
        return _openai_reply(client, model, messages, stream)


def _openai_reply(client: openai.OpenAI, model: str, messages: list[ChatCompletionMessageParam],
                  stream: bool) -> tuple[str, list[dict[str, str]], str | None, Any]:
    kwargs: dict[str, Any] = {"model": model, "messages": messages, "tools": OPENAI_TOOLS,
                              "tool_choice": "auto", "max_tokens": 300, "stop": ["END"]}
    if model.startswith("br/"):
        kwargs["temperature"] = 0.5  # Anthropic's Messages API (as its SDK has it) has none
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        message = reply.choices[0].message
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in message.tool_calls or [] if c.type == "function"]
        return message.content or "", calls, reply.choices[0].finish_reason, reply.usage
    text, finish, usage = "", None, None
    slots: dict[int, dict[str, str]] = {}
    for chunk in client.chat.completions.create(**kwargs, stream=True,
                                                stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for tc in choice.delta.tool_calls or []:
                slot = slots.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] += tc.id or ""
                slot["name"] += (tc.function and tc.function.name) or ""
                slot["arguments"] += (tc.function and tc.function.arguments) or ""
    return text, [slots[i] for i in sorted(slots)], finish, usage


def _expected_native(profile: str, model: str, turns: list[dict[str, Any]]) -> dict[str, Any]:
    """The request an Anthropic or Bedrock provider should get for `turns`
    (neutral: role, text | tool_use | tool_result), with OPENAI_TOOLS,
    max tokens 300, stop ["END"], system "Be brief." (and for Bedrock
    temperature 0.5)."""
    if profile == "an":
        blocks = {"text": lambda t: {"type": "text", "text": t["text"]},
                  "tool_use": lambda t: {"type": "tool_use", "id": t["id"], "name": t["name"],
                                         "input": t["input"]},
                  "tool_result": lambda t: {"type": "tool_result", "tool_use_id": t["id"],
                                            "content": [{"type": "text", "text": t["text"]}]}}
        return {"model": model, "max_tokens": 300, "messages": [
            {"role": t["role"], "content": [blocks[t["kind"]](t)]} for t in turns],
            "system": [{"type": "text", "text": "Be brief."}],
            "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "auto"},
            "stop_sequences": ["END"]}
    converse: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
        "text": lambda t: {"text": t["text"]},
        "tool_use": lambda t: {"toolUse": {"toolUseId": t["id"], "name": t["name"],
                                           "input": t["input"]}},
        "tool_result": lambda t: {"toolResult": {"toolUseId": t["id"],
                                                 "content": [{"text": t["text"]}]}}}
    return {"messages": [{"role": t["role"], "content": [converse[t["kind"]](t)]}
                         for t in turns],  # modelId goes in the URL
            "system": [{"text": "Be brief."}],
            "inferenceConfig": {"maxTokens": 300, "temperature": 0.5, "stopSequences": ["END"]},
            "toolConfig": {"tools": [{"toolSpec": {
                "name": "get_weather", "inputSchema": {"json": SCHEMA},
                "description": "The weather in a city"}}], "toolChoice": {"auto": {}}}}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("profile", ["an", "br"])
def test_the_openai_sdk_reaches_anthropic_and_bedrock(gateway: Gateway, emu: EmulatorClient,
                                                      profile: str, stream: bool) -> None:
    key = f"oa-to-{profile}-{stream}"
    model = "claude-emu" if profile == "an" else "emu-model"
    emu.script(key, [{"fault": "ok", "tool_call": CALL, "chunks": 5}, {"fault": "ok"}])
    question: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"}]
    text, calls, finish, usage = _openai_call(gateway, f"{profile}/{model}#{key}", question,
                                              stream)
    sent = _sent(emu, key)
    assert (text, finish) == ("", "tool_calls")
    assert calls == [sent["tool_call"]]  # id, name and arguments as the provider sent them
    inp, out = TO_OPENAI[profile]
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (
        sent["usage"][inp], sent["usage"][out])
    turns: list[dict[str, Any]] = [{"role": "user", "kind": "text", "text": "Weather in Paris?"}]
    assert _body(sent) == _expected_native(profile, f"{model}#{key}", turns)

    call = calls[0]
    follow_up: list[ChatCompletionMessageParam] = [*question, {
        "role": "assistant", "content": None, "tool_calls": [{
            "id": call["id"], "type": "function",
            "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": "18 C"}]
    text, calls, finish, usage = _openai_call(gateway, f"{profile}/{model}#{key}", follow_up,
                                              stream)
    sent = _sent(emu, key)
    assert (text, calls, finish) == (sent["text"], [], "stop") and text
    assert usage is not None and usage.total_tokens == sum(sent["usage"][k] for k in (inp, out))
    turns += [{"role": "assistant", "kind": "tool_use", "id": call["id"],
               "name": "get_weather", "input": json.loads(CALL["arguments"])},
              {"role": "user", "kind": "tool_result", "id": call["id"], "text": "18 C"}]
    assert _body(sent) == _expected_native(profile, f"{model}#{key}", turns)


# ---- the anthropic SDK served by an OpenAI and a Bedrock profile ---------------------

def _anthropic_call(gateway: Gateway, model: str, messages: list[MessageParam],
                    stream: bool) -> anthropic.types.Message:
    kwargs: dict[str, Any] = {"model": model, "max_tokens": 300, "system": "Be brief.",
                              "messages": messages, "tools": ANTHROPIC_TOOLS,
                              "tool_choice": {"type": "auto"}}
    with gateway.anthropic() as client:
        if not stream:
            whole: anthropic.types.Message = client.messages.create(**kwargs)
            return whole
        with client.messages.stream(**kwargs) as events:
            return events.get_final_message()


def _expected_from_anthropic(profile: str, model: str, follow_up: dict[str, str] | None
                             ) -> dict[str, Any]:
    if profile == "br":
        body = _expected_native("br", model, [
            {"role": "user", "kind": "text", "text": "Weather in Paris?"}, *([] if not follow_up
            else [{"role": "assistant", "kind": "tool_use", "name": "get_weather",
                   "id": follow_up["id"], "input": json.loads(CALL["arguments"])},
                  {"role": "user", "kind": "tool_result", "id": follow_up["id"],
                   "text": "18 C"}])])
        body["inferenceConfig"] = {"maxTokens": 300}
        return body
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Weather in Paris?"}]
    if follow_up:
        messages += [{"role": "assistant", "content": None, "tool_calls": [{
            "id": follow_up["id"], "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city":"Paris","unit":"C"}'}}]},
            {"role": "tool", "tool_call_id": follow_up["id"], "content": "18 C"}]
    return {"model": model, "messages": messages, "tools": OPENAI_TOOLS, "tool_choice": "auto",
            "max_completion_tokens": 300}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("profile", ["oa", "br"])
def test_the_anthropic_sdk_reaches_openai_and_bedrock(gateway: Gateway, emu: EmulatorClient,
                                                      profile: str, stream: bool) -> None:
    key = f"an-to-{profile}-{stream}"
    model = "gpt-emu" if profile == "oa" else "emu-model"
    emu.script(key, [{"fault": "ok", "tool_call": CALL, "chunks": 5}, {"fault": "ok"}])
    question: list[MessageParam] = [{"role": "user", "content": "Weather in Paris?"}]
    final = _anthropic_call(gateway, f"{profile}/{model}#{key}", question, stream)
    sent = _sent(emu, key)
    uses = [b for b in final.content if b.type == "tool_use"]
    assert [(u.id, u.name, u.input) for u in uses] == [
        (sent["tool_call"]["id"], "get_weather", json.loads(CALL["arguments"]))]
    assert final.stop_reason == "tool_use"
    inp, out = TO_ANTHROPIC[profile]
    assert (final.usage.input_tokens, final.usage.output_tokens) == (
        sent["usage"][inp], sent["usage"][out])
    assert _body(sent) == _expected_from_anthropic(profile, f"{model}#{key}", None)

    follow_up: list[MessageParam] = [*question,
                                     {"role": "assistant", "content": [{
                                         "type": "tool_use", "id": uses[0].id,
                                         "name": uses[0].name, "input": uses[0].input}]},
                                     {"role": "user", "content": [{
                                         "type": "tool_result", "tool_use_id": uses[0].id,
                                         "content": "18 C"}]}]
    final = _anthropic_call(gateway, f"{profile}/{model}#{key}", follow_up, stream)
    sent = _sent(emu, key)
    texts = [b.text for b in final.content if b.type == "text"]
    assert texts == [sent["text"]] and final.stop_reason == "end_turn"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (
        sent["usage"][inp], sent["usage"][out])
    assert _body(sent) == _expected_from_anthropic(profile, f"{model}#{key}",
                                                   {"id": uses[0].id})


def test_an_image_reaches_bedrock_as_its_bytes(gateway: Gateway, emu: EmulatorClient) -> None:
    """A data URL's image goes to Converse as bytes: through the submit, the
    journal and the worker as bytes, and botocore sends them in base64."""
    png = "iVBORw0KGgo="
    emu.script("picture", [{"fault": "ok"}])
    with gateway.openai() as client:
        reply = client.chat.completions.create(model="br/emu-model#picture", messages=[
            {"role": "user", "content": [
                {"type": "text", "text": "What is it?"},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}]}])
    sent = _sent(emu, "picture")
    assert reply.choices[0].message.content == sent["text"]
    assert sent["request"]["messages"] == [{"role": "user", "content": [
        {"text": "What is it?"}, {"image": {"format": "png", "source": {"bytes": png}}}]}]


# ---- what the target cannot express ---------------------------------------------------

def test_an_untranslatable_request_is_a_400_naming_the_field(gateway: Gateway,
                                                             emu: EmulatorClient) -> None:
    emu.script("refused", [{"fault": "ok"}])
    with gateway.openai() as client, pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="an/claude-emu#refused", messages=[
            {"role": "user", "content": [
                {"type": "text", "text": "What is said?"},
                {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}])
    assert refused.value.body == {
        "message": "messages[0].content[1].type: 'input_audio' cannot be sent to an "
                   "anthropic profile", "type": "invalid_request_error", "param": None,
        "code": "bad_message"}
    with gateway.anthropic() as claude, pytest.raises(anthropic.BadRequestError) as also:
        claude.messages.create(
            model="br/emu-model#refused", max_tokens=10, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "url", "url": "https://x.test/a.png"}}]}])
    assert also.value.body == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "messages[0].content[0]: an image by URL (Converse takes the image's "
                   "bytes) cannot be sent to a bedrock profile"}}
    assert emu.log("refused") == []  # nothing reached the provider
