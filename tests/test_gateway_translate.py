"""gateway/translate.py, pure: each caller wire's request written in each
other wire (the mapping tables, case by case), and the refusals, each
naming the caller's field. The same paths through real SDKs, a daemon and
the emulator: tests/test_gateway_translate_e2e.py."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamfence.gateway.neutral import Untranslatable
from streamfence.gateway.to_wire import DEFAULT_MAX_TOKENS
from streamfence.gateway.translate import translate
from streamfence.supervisor.requests import check_request

PNG = "iVBORw0KGgo="  # base64 of the PNG signature
PNG_BYTES = b"\x89PNG\r\n\x1a\n"
SCHEMA = {"type": "object", "properties": {"q": {"type": "string"}}}


def _openai(**fields: Any) -> dict[str, Any]:
    return {"model": "caller-model", "messages": [{"role": "user", "content": "hi"}], **fields}


def _anthropic(**fields: Any) -> dict[str, Any]:
    return {"model": "caller-model", "max_tokens": 50,
            "messages": [{"role": "user", "content": "hi"}], **fields}


HI_ANTHROPIC = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
HI_BEDROCK = [{"role": "user", "content": [{"text": "hi"}]}]
HI_OPENAI = [{"role": "user", "content": "hi"}]

# (caller wire, caller body, target wire, the target's body)
CASES: list[tuple[str, dict[str, Any], str, dict[str, Any]]] = [
    # a plain question; Anthropic's required max_tokens gets the default
    ("openai", _openai(), "anthropic",
     {"model": "m", "max_tokens": DEFAULT_MAX_TOKENS, "messages": HI_ANTHROPIC}),
    ("openai", _openai(), "bedrock", {"modelId": "m", "messages": HI_BEDROCK}),
    ("anthropic", _anthropic(), "openai",
     {"model": "m", "messages": HI_OPENAI, "max_completion_tokens": 50}),
    ("anthropic", _anthropic(), "bedrock",
     {"modelId": "m", "messages": HI_BEDROCK, "inferenceConfig": {"maxTokens": 50}}),
    # system prompts, sampling, stop sequences, the end user
    ("openai", _openai(messages=[{"role": "developer", "content": "S"}, *HI_OPENAI],
                       max_completion_tokens=9, stop="X", user="u1", n=1), "anthropic",
     {"model": "m", "max_tokens": 9, "messages": HI_ANTHROPIC,
      "system": [{"type": "text", "text": "S"}], "stop_sequences": ["X"],
      "metadata": {"user_id": "u1"}}),
    ("openai", _openai(messages=[{"role": "system", "content": [
        {"type": "text", "text": "A"}, {"type": "text", "text": "B"}]}, *HI_OPENAI],
        max_tokens=9, temperature=0.2, top_p=0.9, stop=["X", "Y"]), "bedrock",
     {"modelId": "m", "messages": HI_BEDROCK, "system": [{"text": "A"}, {"text": "B"}],
      "inferenceConfig": {"maxTokens": 9, "temperature": 0.2, "topP": 0.9,
                          "stopSequences": ["X", "Y"]}}),
    ("anthropic", _anthropic(system="S", temperature=0.3, top_p=0.8, stop_sequences=["X"],
                             metadata={"user_id": "u1"}), "openai",
     {"model": "m", "messages": [{"role": "system", "content": "S"}, *HI_OPENAI],
      "max_completion_tokens": 50, "temperature": 0.3, "top_p": 0.8, "stop": ["X"],
      "user": "u1"}),
    # images: a data URL is base64 for Anthropic, bytes for Bedrock, and back
    ("openai", _openai(messages=[{"role": "user", "content": [
        {"type": "text", "text": "see"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
        {"type": "image_url", "image_url": {"url": "https://x.test/a.png", "detail": "auto"}}]}]),
     "anthropic",
     {"model": "m", "max_tokens": DEFAULT_MAX_TOKENS, "messages": [{"role": "user", "content": [
         {"type": "text", "text": "see"},
         {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
         {"type": "image", "source": {"type": "url", "url": "https://x.test/a.png"}}]}]}),
    ("anthropic", _anthropic(messages=[{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": PNG}}]}]), "bedrock",
     {"modelId": "m", "inferenceConfig": {"maxTokens": 50}, "messages": [{"role": "user", "content": [
         {"image": {"format": "png", "source": {"bytes": PNG_BYTES}}}]}]}),
    ("anthropic", _anthropic(messages=[{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": PNG}}]}]), "openai",
     {"model": "m", "max_completion_tokens": 50, "messages": [{"role": "user", "content": [
         {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}]}]}),
    # tools, a tool call, its result (OpenAI's tool message and the user's next
    # words are one user turn elsewhere), tool_choice both ways
    ("openai", _openai(
        messages=[*HI_OPENAI,
                  {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                   "function": {"name": "f", "arguments": '{"q": "x"}'}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": "r"},
                  {"role": "user", "content": "and?"}],
        tools=[{"type": "function", "function": {"name": "f", "description": "d",
                                                 "parameters": SCHEMA}}],
        tool_choice={"type": "function", "function": {"name": "f"}}, parallel_tool_calls=False),
     "anthropic",
     {"model": "m", "max_tokens": DEFAULT_MAX_TOKENS, "messages": [
         *HI_ANTHROPIC,
         {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "f",
                                            "input": {"q": "x"}}]},
         {"role": "user", "content": [
             {"type": "tool_result", "tool_use_id": "c1", "content": [{"type": "text", "text": "r"}]},
             {"type": "text", "text": "and?"}]}],
      "tools": [{"name": "f", "description": "d", "input_schema": SCHEMA}],
      "tool_choice": {"type": "tool", "name": "f", "disable_parallel_tool_use": True}}),
    ("openai", _openai(
        messages=[*HI_OPENAI,
                  {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                   "function": {"name": "f", "arguments": "{}"}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "r"}]}],
        tools=[{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}],
        tool_choice="required"), "bedrock",
     {"modelId": "m", "messages": [
         *HI_BEDROCK,
         {"role": "assistant", "content": [{"toolUse": {"toolUseId": "c1", "name": "f", "input": {}}}]},
         {"role": "user", "content": [{"toolResult": {"toolUseId": "c1", "content": [{"text": "r"}]}}]}],
      "toolConfig": {"tools": [{"toolSpec": {"name": "f", "inputSchema": {"json": SCHEMA}}}],
                     "toolChoice": {"any": {}}}}),
    ("anthropic", _anthropic(
        messages=[*HI_ANTHROPIC, {"role": "assistant", "content": [
            {"type": "text", "text": "let me look"},
            {"type": "tool_use", "id": "t1", "name": "f", "input": {"q": "x"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": "r"}]}],
        tools=[{"name": "f", "input_schema": SCHEMA}], tool_choice={"type": "any"}), "openai",
     {"model": "m", "max_completion_tokens": 50, "messages": [
         *HI_OPENAI,
         {"role": "assistant", "content": "let me look", "tool_calls": [
             {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"q":"x"}'}}]},
         {"role": "tool", "tool_call_id": "t1", "content": "r"}],
      "tools": [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}],
      "tool_choice": "required"}),
    ("anthropic", _anthropic(
        system=[{"type": "text", "text": "S", "cache_control": {"type": "ephemeral"}}],
        messages=[*HI_ANTHROPIC, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "is_error": True, "content": [{"type": "text", "text": "no"}]}]}],
        tools=[{"name": "f", "input_schema": SCHEMA, "cache_control": {"type": "ephemeral"}}],
        tool_choice={"type": "tool", "name": "f"}), "bedrock",
     {"modelId": "m", "inferenceConfig": {"maxTokens": 50},
      "system": [{"text": "S"}, {"cachePoint": {"type": "default"}}], "messages": [
         *HI_BEDROCK,
         {"role": "assistant", "content": [{"toolUse": {"toolUseId": "t1", "name": "f", "input": {}}}]},
         {"role": "user", "content": [{"toolResult": {"toolUseId": "t1", "content": [{"text": "no"}],
                                                      "status": "error"}}]}],
      "toolConfig": {"tools": [{"toolSpec": {"name": "f", "inputSchema": {"json": SCHEMA}}},
                               {"cachePoint": {"type": "default"}}],
                     "toolChoice": {"tool": {"name": "f"}}}}),
]


@pytest.mark.parametrize(("source", "body", "target", "expected"), CASES)
def test_a_request_in_another_wire(source: str, body: dict[str, Any], target: str,
                                   expected: dict[str, Any]) -> None:
    out = translate(body, source, target, "m")
    assert out == expected
    check_request(target, out)  # what the supervisor admits for that wire


# (caller wire, caller body, target wire, the 400's message)
REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    ("openai", _openai(messages=[{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}}]}]), "anthropic",
     "messages[0].content[0].type: 'input_audio' cannot be sent to an anthropic profile"),
    ("openai", _openai(seed=7), "bedrock", "seed: this field cannot be sent to a bedrock profile"),
    ("openai", _openai(n=2), "anthropic", "n: this field cannot be sent to an anthropic profile"),
    ("openai", _openai(temperature=0.5), "anthropic",
     "temperature: this field cannot be sent to an anthropic profile"),
    ("openai", _openai(messages=[*HI_OPENAI, {"role": "system", "content": "late"}]), "bedrock",
     "messages[1]: a system message after the conversation's first turn cannot be sent to a "
     "bedrock profile"),
    ("openai", _openai(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "https://x.test/a.png"}}]}]), "bedrock",
     "messages[0].content[0]: an image by URL (Converse takes the image's bytes) cannot be sent "
     "to a bedrock profile"),
    ("openai", _openai(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "https://x.test/a.png", "detail": "high"}}]}]), "anthropic",
     "messages[0].content[0].image_url.detail: 'high' cannot be sent to an anthropic profile"),
    ("openai", _openai(messages=[{"role": "user", "content": "hi", "name": "bob"}]), "anthropic",
     "messages[0].name: this field cannot be sent to an anthropic profile"),
    ("openai", _openai(tool_choice="none", tools=[{"type": "function", "function": {"name": "f"}}]),
     "bedrock", "tool_choice: 'none' cannot be sent to a bedrock profile"),
    ("openai", _openai(parallel_tool_calls=False), "bedrock",
     "parallel_tool_calls: asking for one tool call at most cannot be sent to a bedrock profile"),
    ("openai", _openai(user="u1"), "bedrock",
     "user: an end-user id cannot be sent to a bedrock profile"),
    ("openai", _openai(messages=[{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
        "function": {"name": "f", "arguments": "[1]"}}]}]), "anthropic",
     "messages[0].tool_calls[0].function.arguments: must be a JSON object"),
    ("openai", _openai(messages="hi"), "anthropic", "messages: must be a list"),
    ("anthropic", _anthropic(messages=[{"role": "user", "content": [{"type": "tool_result",
        "tool_use_id": "t1", "content": [{"type": "tool_result", "tool_use_id": "t2"}]}]}]),
     "openai", "messages[0].content[0].content[0].type: 'tool_result' inside a tool_result "
     "cannot be sent to an openai profile"),
    ("openai", _openai(messages=[{"role": ["user"], "content": "hi"}]), "anthropic",
     "messages[0].role: ['user'] cannot be sent to an anthropic profile"),
    ("openai", _openai(messages=[{"role": "x" * 10_000, "content": "hi"}]), "anthropic",
     f"messages[0].role: '{'x' * 56}... cannot be sent to an anthropic profile"),
    ("anthropic", _anthropic(messages=[{"role": "user", "content": [{"type": "document",
        "source": {}}]}]), "openai",
     "messages[0].content[0].type: 'document' cannot be sent to an openai profile"),
    ("anthropic", _anthropic(thinking={"type": "enabled", "budget_tokens": 1024}), "openai",
     "thinking: this field cannot be sent to an openai profile"),
    ("anthropic", _anthropic(top_k=5), "bedrock",
     "top_k: this field cannot be sent to a bedrock profile"),
    ("anthropic", _anthropic(system=[{"type": "text", "text": "S",
                                      "cache_control": {"type": "ephemeral"}}]), "openai",
     "system[0].cache_control: a cache breakpoint cannot be sent to an openai profile"),
    ("anthropic", _anthropic(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
     "openai", "tools[0].type: the server tool 'web_search_20250305' cannot be sent to an "
     "openai profile"),
    ("anthropic", _anthropic(messages=[*HI_ANTHROPIC, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "t", "signature": ""}]}]), "bedrock",
     "messages[1].content[0].type: 'thinking' cannot be sent to a bedrock profile"),
    ("anthropic", _anthropic(messages=[{"role": "user", "content": [{"type": "tool_result",
        "tool_use_id": "t1", "is_error": True, "content": "boom"}]}]), "openai",
     "messages[0].content[0].is_error: a tool result marked as an error cannot be sent to an "
     "openai profile"),
    ("anthropic", _anthropic(messages=[{"role": "user", "content": [{"type": "tool_result",
        "tool_use_id": "t1", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": PNG}}]}]}]), "openai",
     "messages[0].content[0].content[0]: an image in a tool result cannot be sent to an "
     "openai profile"),
    ("anthropic", _anthropic(messages=[{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/tiff", "data": PNG}}]}]), "bedrock",
     "messages[0].content[0]: an image of type 'image/tiff' cannot be sent to a bedrock profile"),
    ("anthropic", _anthropic(tool_choice={"type": "auto", "disable_parallel_tool_use": True}),
     "bedrock", "tool_choice.disable_parallel_tool_use: asking for one tool call at most cannot "
     "be sent to a bedrock profile"),
]


@pytest.mark.parametrize(("source", "body", "target", "message"), REFUSED)
def test_what_the_target_cannot_express_is_refused_by_name(source: str, body: dict[str, Any],
                                                           target: str, message: str) -> None:
    with pytest.raises(Untranslatable) as refused:
        translate(body, source, target, "m")
    assert str(refused.value) == message


def test_fields_at_their_default_ask_for_nothing() -> None:
    """OpenAI's `n: 1`, `logprobs: false`, `store: false`, `parallel_tool_calls:
    true`, a tool's `strict: false` and Anthropic's disabled thinking pass: each
    asks for what the target does anyway."""
    body = _openai(n=1, logprobs=False, store=False, parallel_tool_calls=True, tools=[
        {"type": "function", "function": {"name": "f", "strict": False}}])
    assert translate(body, "openai", "bedrock", "m")["toolConfig"] == {"tools": [
        {"toolSpec": {"name": "f", "inputSchema": {"json": {"type": "object", "properties": {}}}}}]}
    assert "thinking" not in translate(_anthropic(thinking={"type": "disabled"}), "anthropic",
                                       "openai", "m")


_KEYS = ["model", "messages", "role", "content", "type", "text", "image_url", "url", "source",
         "tool_calls", "function", "name", "arguments", "tool_call_id", "tools", "parameters",
         "tool_choice", "input", "tool_use_id", "system", "max_tokens", "stop", "metadata",
         "cache_control", "is_error", "media_type", "data", "input_schema", "user"]
_VALUES = ["user", "assistant", "system", "tool", "text", "image", "image_url", "tool_use",
           "tool_result", "function", "base64", "url", "auto", "any", "none", "required",
           "data:image/png;base64,AA==", "https://x.test/a.png", "{}", "[1]", "image/png"]
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
    | st.sampled_from(_VALUES) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.sampled_from(_KEYS), inner, max_size=4), max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(body=st.dictionaries(st.sampled_from(_KEYS), _JSON, max_size=5),
       source=st.sampled_from(["openai", "anthropic"]),
       target=st.sampled_from(["openai", "anthropic", "bedrock"]))
def test_any_body_is_translated_or_refused_never_an_other_error(
        body: dict[str, Any], source: str, target: str) -> None:
    """A caller's body is bytes from outside: the only error is Untranslatable
    (the gateway's 400), whatever its shape."""
    with contextlib.suppress(Untranslatable):
        translate(body, source, target, "m")


def test_a_deeply_nested_body_is_refused_not_a_recursion_error() -> None:
    """Tool results nested as deep as a JSON parser lets them (a few hundred
    levels) are refused at the first inner one, without recursion."""
    block: dict[str, Any] = {"type": "tool_result", "tool_use_id": "t"}
    for _ in range(600):
        block = {"type": "tool_result", "tool_use_id": "t", "content": [block]}
    body = _anthropic(messages=[{"role": "user", "content": [block]}])
    with pytest.raises(Untranslatable, match=r"content\[0\]\.content\[0\]\.type: 'tool_result'"):
        translate(body, "anthropic", "openai", "m")
