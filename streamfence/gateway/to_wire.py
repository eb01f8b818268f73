"""The neutral form (gateway/neutral.py) written as a target's native
request: exactly the body its worker sends (workers/openai_chat.py,
anthropic_messages.py, bedrock_converse.py) and the supervisor admits
(supervisor/requests.py's FIELDS).

Contract: `write_openai(chat, model)`, `write_anthropic(chat, model)`,
`write_bedrock(chat, model)` -> the request body, or Untranslatable naming
the caller's field of a piece the wire cannot express. Pure.

What each wire cannot express (refused, never left out):
- openai: a tool result that is an error (`is_error`: OpenAI's tool message
  has no such flag) or holds an image; an image in an assistant turn;
  Anthropic's cache breakpoints.
- anthropic: an image in an assistant turn; temperature and top_p (the
  Messages API the workers' anthropic SDK speaks has neither;
  supervisor/requests.py refuses them too).
- bedrock: an image by URL (Converse takes bytes) or of a format other than
  png, jpeg, gif, webp; `tool_choice` "none"; at most one tool call
  (`parallel_tool_calls: false`); an end-user id.

Choices made where the wires differ, said once here:
- max tokens: OpenAI's `max_completion_tokens` (what its current models
  take); Anthropic requires one, so a request without it gets
  DEFAULT_MAX_TOKENS (an identity's cap, supervisor/requests.py, still
  applies above it).
- A tool call's arguments are re-encoded as compact JSON for OpenAI (the
  decoded object is what the caller meant); images by base64 become data
  URLs for OpenAI and raw bytes for Bedrock (botocore encodes them).
- Several system texts stay several: OpenAI gets them as text parts of one
  system message, Anthropic as text blocks, Bedrock as system blocks.
"""

from __future__ import annotations

import base64
from typing import Any

import orjson

from streamfence.gateway.neutral import (
    Block,
    Chat,
    Image,
    Text,
    ToolCall,
    ToolResult,
    cannot,
    malformed,
    shown,
)

DEFAULT_MAX_TOKENS = 4096
_OPENAI_CHOICE = {"auto": "auto", "any": "required", "none": "none"}
_BEDROCK_FORMATS = {"image/png": "png", "image/jpeg": "jpeg", "image/jpg": "jpeg",
                    "image/gif": "gif", "image/webp": "webp"}
_EPHEMERAL = {"type": "ephemeral"}
_CACHE_POINT = {"cachePoint": {"type": "default"}}


def _set(body: dict[str, Any], key: str, value: Any) -> None:
    if value is not None:
        body[key] = value


# ---- OpenAI's chat completions ---------------------------------------------------

def write_openai(chat: Chat, model: str) -> dict[str, Any]:
    """See the module docstring."""
    messages: list[dict[str, Any]] = []
    if chat.system:
        messages.append({"role": "system", "content": _openai_content(chat.system)})
    for turn in chat.turns:
        if turn.role == "assistant":
            messages.append(_openai_assistant(turn.blocks))
            continue
        parts: list[Text | Image] = []
        for block in turn.blocks:
            if isinstance(block, ToolResult):
                messages.append(_openai_tool_result(block))
            elif isinstance(block, Text | Image):
                parts.append(block)
        if parts:
            messages.append({"role": "user", "content": _openai_content(parts)})
    body: dict[str, Any] = {"model": model, "messages": messages}
    if chat.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, **({"description": t.description} if t.description else {}),
            "parameters": t.schema}} for t in chat.tools if _no_cache(t)]
    if chat.choice is not None:
        c = chat.choice
        body["tool_choice"] = _OPENAI_CHOICE.get(c.mode) or {
            "type": "function", "function": {"name": c.name}}
    if not chat.parallel:
        body["parallel_tool_calls"] = False
    _set(body, "max_completion_tokens", chat.max_tokens)
    _set(body, "temperature", chat.temperature)
    _set(body, "top_p", chat.top_p)
    if chat.stop:
        body["stop"] = chat.stop
    _set(body, "user", chat.user)
    return body


def _no_cache(piece: Any) -> bool:
    if piece.cache:
        raise cannot(f"{piece.path}.cache_control", "a cache breakpoint", "openai")
    return True


def _openai_content(parts: list[Text] | list[Text | Image]) -> str | list[dict[str, Any]]:
    """One text is a string; else parts (text, image_url)."""
    if len(parts) == 1 and isinstance(parts[0], Text) and _no_cache(parts[0]):
        return parts[0].text
    out: list[dict[str, Any]] = []
    for part in parts:
        if isinstance(part, Text):
            _no_cache(part)
            out.append({"type": "text", "text": part.text})
        else:
            url = part.url or f"data:{part.media_type};base64,{part.data}"
            out.append({"type": "image_url", "image_url": {"url": url}})
    return out


def _openai_tool_result(result: ToolResult) -> dict[str, Any]:
    if result.is_error:
        raise cannot(f"{result.path}.is_error", "a tool result marked as an error", "openai")
    texts: list[Text] = []
    for part in result.content:
        if not isinstance(part, Text):
            raise cannot(part.path, "an image in a tool result", "openai")
        texts.append(part)
    content: str | list[dict[str, Any]] = "" if not texts else _openai_content(texts)
    return {"role": "tool", "tool_call_id": result.id, "content": content}


def _openai_assistant(blocks: list[Block]) -> dict[str, Any]:
    texts: list[Text] = []
    calls: list[dict[str, Any]] = []
    for block in blocks:
        if isinstance(block, Text):
            texts.append(block)
        elif isinstance(block, ToolCall):
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": orjson.dumps(block.arguments).decode()}})
        else:
            raise cannot(block.path, f"{_kind(block)} in an assistant turn", "openai")
    message: dict[str, Any] = {"role": "assistant",
                               "content": _openai_content(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    return message


def _kind(block: Block) -> str:
    return {Image: "an image", ToolResult: "a tool result"}.get(type(block), "this block")


# ---- Anthropic's messages ----------------------------------------------------------

def write_anthropic(chat: Chat, model: str) -> dict[str, Any]:
    """See the module docstring."""
    body: dict[str, Any] = {"model": model,
                            "max_tokens": chat.max_tokens or DEFAULT_MAX_TOKENS,
                            "messages": [{"role": t.role, "content": [
                                _anthropic_block(b, t.role) for b in t.blocks]}
                                for t in chat.turns]}
    if chat.system:
        body["system"] = [_anthropic_text(t) for t in chat.system]
    if chat.tools:
        body["tools"] = [{"name": t.name,
                          **({"description": t.description} if t.description else {}),
                          "input_schema": t.schema,
                          **({"cache_control": _EPHEMERAL} if t.cache else {})}
                         for t in chat.tools]
    choice: dict[str, Any] | None = None
    if chat.choice is not None:
        choice = {"type": chat.choice.mode}
        _set(choice, "name", chat.choice.name)
    if not chat.parallel:
        choice = {**(choice or {"type": "auto"}), "disable_parallel_tool_use": True}
    _set(body, "tool_choice", choice)
    for slot in ("temperature", "top_p"):  # the Messages API of the SDK we speak has neither
        if getattr(chat, slot) is not None:
            raise cannot(chat.paths[slot], "this field", "anthropic")
    if chat.stop:
        body["stop_sequences"] = chat.stop
    if chat.user is not None:
        body["metadata"] = {"user_id": chat.user}
    return body


def _anthropic_text(text: Text) -> dict[str, Any]:
    block: dict[str, Any] = {"type": "text", "text": text.text}
    if text.cache:
        block["cache_control"] = _EPHEMERAL
    return block


def _anthropic_image(image: Image) -> dict[str, Any]:
    source = {"type": "url", "url": image.url} if image.url else {
        "type": "base64", "media_type": image.media_type, "data": image.data}
    return {"type": "image", "source": source}


def _anthropic_block(block: Block, role: str) -> dict[str, Any]:
    if isinstance(block, Text):
        return _anthropic_text(block)
    if isinstance(block, Image):
        if role == "assistant":
            raise cannot(block.path, "an image in an assistant turn", "anthropic")
        return _anthropic_image(block)
    if isinstance(block, ToolCall):
        return {"type": "tool_use", "id": block.id, "name": block.name,
                "input": block.arguments}
    out: dict[str, Any] = {"type": "tool_result", "tool_use_id": block.id, "content": [
        _anthropic_text(p) if isinstance(p, Text) else _anthropic_image(p)
        for p in block.content]}
    if block.is_error:
        out["is_error"] = True
    return out


# ---- Bedrock's Converse --------------------------------------------------------------

def write_bedrock(chat: Chat, model: str) -> dict[str, Any]:
    """See the module docstring."""
    if chat.user is not None:
        raise cannot(chat.paths["user"], "an end-user id", "bedrock")
    if not chat.parallel:
        raise cannot(chat.paths["parallel"], "asking for one tool call at most", "bedrock")
    body: dict[str, Any] = {"modelId": model, "messages": [
        {"role": t.role, "content": [piece for b in t.blocks for piece in _bedrock_block(b)]}
        for t in chat.turns]}
    if chat.system:
        body["system"] = [piece for t in chat.system for piece in _bedrock_text(t)]
    config: dict[str, Any] = {}
    _set(config, "maxTokens", chat.max_tokens)
    _set(config, "temperature", chat.temperature)
    _set(config, "topP", chat.top_p)
    if chat.stop:
        config["stopSequences"] = chat.stop
    if config:
        body["inferenceConfig"] = config
    if chat.tools or chat.choice is not None:
        body["toolConfig"] = _bedrock_tools(chat)
    return body


def _bedrock_tools(chat: Chat) -> dict[str, Any]:
    tools: list[dict[str, Any]] = []
    for t in chat.tools:
        spec: dict[str, Any] = {"name": t.name, "inputSchema": {"json": t.schema}}
        _set(spec, "description", t.description)
        tools.append({"toolSpec": spec})
        if t.cache:
            tools.append(_CACHE_POINT)
    config: dict[str, Any] = {"tools": tools}
    choice = chat.choice
    if choice is not None:
        if choice.mode == "none":
            raise cannot(choice.path, "'none'", "bedrock")
        config["toolChoice"] = {"tool": {"name": choice.name}} if choice.mode == "tool" \
            else {choice.mode: {}}
    return config


def _bedrock_text(text: Text) -> list[dict[str, Any]]:
    return [{"text": text.text}, _CACHE_POINT] if text.cache else [{"text": text.text}]


def _bedrock_image(image: Image) -> dict[str, Any]:
    if image.url is not None:
        raise cannot(image.path, "an image by URL (Converse takes the image's bytes)",
                     "bedrock")
    fmt = _BEDROCK_FORMATS.get(str(image.media_type).lower())
    if fmt is None:
        raise cannot(image.path, f"an image of type {shown(image.media_type)}", "bedrock")
    try:
        data = base64.b64decode(str(image.data), validate=True)
    except ValueError:
        raise malformed(image.path, "an image in base64") from None
    return {"image": {"format": fmt, "source": {"bytes": data}}}


def _bedrock_block(block: Block) -> list[dict[str, Any]]:
    if isinstance(block, Text):
        return _bedrock_text(block)
    if isinstance(block, Image):
        return [_bedrock_image(block)]
    if isinstance(block, ToolCall):
        return [{"toolUse": {"toolUseId": block.id, "name": block.name,
                             "input": block.arguments}}]
    content: list[dict[str, Any]] = []
    for part in block.content:
        if isinstance(part, Text) and part.cache:
            raise cannot(f"{part.path}.cache_control", "a cache breakpoint in a tool result",
                         "bedrock")
        content.append({"text": part.text} if isinstance(part, Text) else _bedrock_image(part))
    result: dict[str, Any] = {"toolUseId": block.id, "content": content}
    if block.is_error:
        result["status"] = "error"
    return [{"toolResult": result}]
