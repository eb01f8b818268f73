"""A caller's request body, OpenAI's chat completions or Anthropic's
messages, read into the neutral form (gateway/neutral.py) for a target of
another kind.

Contract: `read_openai(body, target)` and `read_anthropic(body, target)`
-> Chat, or Untranslatable naming the caller's field. Pure. Each reader
takes the fields it has a place for (`_OPENAI_FIELDS`, `_ANTHROPIC_FIELDS`),
accepts a few others at their default value only (OpenAI's `n: 1`,
`logprobs: false`...: they ask for nothing), and refuses every other field
and every content type it cannot carry, naming it: a request is never sent
with a part left out. `model`, `stream` and `stream_options` are the
gateway's (it routes and streams) and are not read here.
"""

from __future__ import annotations

import binascii
import re
from typing import Any

import orjson

from streamfence.gateway.neutral import (
    Chat,
    Choice,
    Image,
    Text,
    Tool,
    ToolCall,
    ToolResult,
    cannot,
    malformed,
    shown,
)

_GATEWAY_OWNED = frozenset({"model", "stream", "stream_options"})
_OPENAI_FIELDS = frozenset({"messages", "max_tokens", "max_completion_tokens", "temperature",
                            "top_p", "stop", "tools", "tool_choice", "parallel_tool_calls",
                            "user"})
_ANTHROPIC_FIELDS = frozenset({"messages", "max_tokens", "system", "temperature", "top_p",
                               "stop_sequences", "tools", "tool_choice", "metadata"})
# Fields that ask for nothing at these values (the wire's defaults): accepted.
_OPENAI_DEFAULTS: dict[str, Any] = {"n": 1, "logprobs": False, "store": False}
_ANTHROPIC_DEFAULTS: dict[str, Any] = {"thinking": {"type": "disabled"}}
_DATA_URL = re.compile(r"data:(image/[\w.+-]+);base64,(.*)", re.DOTALL)
_OPENAI_TOOL_CHOICE = {"auto": "auto", "required": "any", "none": "none"}


def _check_fields(body: dict[str, Any], kept: frozenset[str], defaults: dict[str, Any],
                  target: str) -> None:
    for key, value in body.items():
        if key in kept or key in _GATEWAY_OWNED:
            continue
        if key in defaults and value == defaults[key]:
            continue
        raise cannot(key, "this field", target)


def _list(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise malformed(path, "a list")
    return value


def _map(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise malformed(path, "an object")
    return value


def _str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise malformed(path, "a string")
    return value


def _number(body: dict[str, Any], key: str, chat: Chat, slot: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise malformed(key, "a number")
    chat.paths[slot] = key
    return value


def _max_tokens(body: dict[str, Any], keys: tuple[str, ...], chat: Chat) -> None:
    for key in keys:
        value = body.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int):
                raise malformed(key, "an integer")
            chat.max_tokens, chat.paths["max_tokens"] = value, key


def _schema(value: Any, path: str) -> dict[str, Any]:
    return {"type": "object", "properties": {}} if value is None else _map(value, path)


# ---- OpenAI's chat completions ---------------------------------------------------

def read_openai(body: dict[str, Any], target: str) -> Chat:
    """See the module docstring."""
    _check_fields(body, _OPENAI_FIELDS, _OPENAI_DEFAULTS, target)
    chat = Chat()
    _max_tokens(body, ("max_tokens", "max_completion_tokens"), chat)
    chat.temperature = _number(body, "temperature", chat, "temperature")
    chat.top_p = _number(body, "top_p", chat, "top_p")
    stop = body.get("stop")
    if stop is not None:
        chat.stop = [stop] if isinstance(stop, str) else \
            [_str(s, f"stop[{i}]") for i, s in enumerate(_list(stop, "stop"))]
        chat.paths["stop"] = "stop"
    if body.get("user") is not None:
        chat.user, chat.paths["user"] = _str(body["user"], "user"), "user"
    if body.get("parallel_tool_calls") is False:
        chat.parallel, chat.paths["parallel"] = False, "parallel_tool_calls"
    for i, tool in enumerate(_list(body.get("tools") or [], "tools")):
        chat.tools.append(_openai_tool(_map(tool, f"tools[{i}]"), f"tools[{i}]", target))
    if body.get("tool_choice") is not None:
        chat.choice = _openai_choice(body["tool_choice"])
    for i, message in enumerate(_list(body.get("messages"), "messages")):
        _openai_message(chat, _map(message, f"messages[{i}]"), f"messages[{i}]", target)
    return chat


def _openai_tool(tool: dict[str, Any], path: str, target: str) -> Tool:
    if tool.get("type") != "function":
        raise cannot(f"{path}.type", shown(tool.get("type")), target)
    fn = _map(tool.get("function"), f"{path}.function")
    for key in fn:
        if key == "strict" and fn[key] is not True:
            continue
        if key not in ("name", "description", "parameters"):
            raise cannot(f"{path}.function.{key}", "this field", target)
    description = fn.get("description")
    return Tool(path, _str(fn.get("name"), f"{path}.function.name"),
                None if description is None else _str(description, f"{path}.function.description"),
                _schema(fn.get("parameters"), f"{path}.function.parameters"))


def _openai_choice(choice: Any) -> Choice:
    if isinstance(choice, str):
        if choice not in _OPENAI_TOOL_CHOICE:
            raise malformed("tool_choice", "'auto', 'required', 'none' or a function")
        return Choice("tool_choice", _OPENAI_TOOL_CHOICE[choice])
    fn = _map(_map(choice, "tool_choice").get("function"), "tool_choice.function")
    return Choice("tool_choice", "tool", _str(fn.get("name"), "tool_choice.function.name"))


_MESSAGE_KEYS = {"system": {"role", "content"}, "developer": {"role", "content"},
                 "user": {"role", "content"}, "tool": {"role", "content", "tool_call_id"},
                 "assistant": {"role", "content", "tool_calls", "refusal"}}


def _openai_message(chat: Chat, message: dict[str, Any], path: str, target: str) -> None:
    role = message.get("role")
    if not isinstance(role, str) or role not in _MESSAGE_KEYS:
        raise cannot(f"{path}.role", shown(role), target)
    for key, value in message.items():
        if key not in _MESSAGE_KEYS[role] and value is not None:
            raise cannot(f"{path}.{key}", "this field", target)
    content = message.get("content")
    if role in ("system", "developer"):
        if chat.turns:
            raise cannot(path, "a system message after the conversation's first turn",
                         target)
        chat.system.extend(_openai_texts(content, f"{path}.content", target))
    elif role == "user":
        for block in _openai_parts(content, f"{path}.content", target):
            chat.add("user", block)
    elif role == "tool":
        call_id = _str(message.get("tool_call_id"), f"{path}.tool_call_id")
        chat.add("user", ToolResult(path, call_id,
                                    tuple(_openai_texts(content, f"{path}.content", target))))
    else:
        _openai_assistant(chat, message, path, target)


def _openai_assistant(chat: Chat, message: dict[str, Any], path: str, target: str) -> None:
    if message.get("refusal"):
        raise cannot(f"{path}.refusal", "an assistant refusal", target)
    content = message.get("content")
    for text in _openai_texts(content, f"{path}.content", target) if content else ():
        if text.text:
            chat.add("assistant", text)
    for k, call in enumerate(_list(message.get("tool_calls") or [], f"{path}.tool_calls")):
        where = f"{path}.tool_calls[{k}]"
        call = _map(call, where)
        fn = _map(call.get("function"), f"{where}.function")
        raw = _str(fn.get("arguments") or "{}", f"{where}.function.arguments")
        try:
            arguments = orjson.loads(raw)
        except orjson.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            raise malformed(f"{where}.function.arguments", "a JSON object")
        chat.add("assistant", ToolCall(where, _str(call.get("id"), f"{where}.id"),
                                       _str(fn.get("name"), f"{where}.function.name"),
                                       arguments))


def _openai_texts(content: Any, path: str, target: str) -> list[Text]:
    """Content that may only be text (system, tool and assistant messages)."""
    out = []
    for block in _openai_parts(content, path, target):
        if not isinstance(block, Text):
            raise cannot(f"{block.path}.type", "'image_url' here", target)
        out.append(block)
    return out


def _openai_parts(content: Any, path: str, target: str) -> list[Text | Image]:
    if isinstance(content, str):
        return [Text(path, content)]
    out: list[Text | Image] = []
    for j, part in enumerate(_list(content, path)):
        where = f"{path}[{j}]"
        part = _map(part, where)
        kind = part.get("type")
        if kind == "text":
            out.append(Text(where, _str(part.get("text"), f"{where}.text")))
        elif kind == "image_url":
            image = _map(part.get("image_url"), f"{where}.image_url")
            if image.get("detail") not in (None, "auto"):
                raise cannot(f"{where}.image_url.detail", shown(image["detail"]), target)
            out.append(_image_url(_str(image.get("url"), f"{where}.image_url.url"), where))
        else:
            raise cannot(f"{where}.type", shown(kind), target)
    return out


def _image_url(url: str, path: str) -> Image:
    data = _DATA_URL.fullmatch(url)
    if data is not None:
        try:
            binascii.a2b_base64(data.group(2), strict_mode=True)
        except binascii.Error:
            raise malformed(f"{path}.image_url.url", "a base64 data URL") from None
        return Image(path, media_type=data.group(1), data=data.group(2))
    if not url.startswith(("http://", "https://")):
        raise malformed(f"{path}.image_url.url", "an http(s) URL or a base64 image data URL")
    return Image(path, url=url)


# ---- Anthropic's messages ----------------------------------------------------------

def read_anthropic(body: dict[str, Any], target: str) -> Chat:
    """See the module docstring."""
    _check_fields(body, _ANTHROPIC_FIELDS, _ANTHROPIC_DEFAULTS, target)
    chat = Chat()
    _max_tokens(body, ("max_tokens",), chat)
    chat.temperature = _number(body, "temperature", chat, "temperature")
    chat.top_p = _number(body, "top_p", chat, "top_p")
    if body.get("stop_sequences") is not None:
        chat.stop = [_str(s, f"stop_sequences[{i}]")
                     for i, s in enumerate(_list(body["stop_sequences"], "stop_sequences"))]
        chat.paths["stop"] = "stop_sequences"
    metadata = _map(body.get("metadata") or {}, "metadata")
    for key, value in metadata.items():
        if key != "user_id":
            raise cannot(f"metadata.{key}", "this field", target)
        if value is not None:
            chat.user, chat.paths["user"] = _str(value, "metadata.user_id"), "metadata.user_id"
    system = body.get("system")
    if system is not None:
        chat.system = _anthropic_texts(system, "system", target)
    for i, tool in enumerate(_list(body.get("tools") or [], "tools")):
        chat.tools.append(_anthropic_tool(_map(tool, f"tools[{i}]"), f"tools[{i}]", target))
    if body.get("tool_choice") is not None:
        _anthropic_choice(chat, _map(body["tool_choice"], "tool_choice"))
    for i, message in enumerate(_list(body.get("messages"), "messages")):
        path = f"messages[{i}]"
        message = _map(message, path)
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise cannot(f"{path}.role", shown(role), target)
        for key in message:
            if key not in ("role", "content"):
                raise cannot(f"{path}.{key}", "this field", target)
        for block in _anthropic_blocks(message.get("content"), f"{path}.content", target):
            chat.add(role, block)
    return chat


def _cache(block: dict[str, Any], path: str, target: str, allowed: bool = True) -> bool:
    cache = block.get("cache_control")
    if cache is None:
        return False
    if not allowed:
        raise cannot(f"{path}.cache_control", "a cache breakpoint here", target)
    return True


def _anthropic_tool(tool: dict[str, Any], path: str, target: str) -> Tool:
    if tool.get("type") not in (None, "custom"):
        raise cannot(f"{path}.type", f"the server tool {shown(tool['type'])}", target)
    for key in tool:
        if key not in ("type", "name", "description", "input_schema", "cache_control"):
            raise cannot(f"{path}.{key}", "this field", target)
    description = tool.get("description")
    return Tool(path, _str(tool.get("name"), f"{path}.name"),
                None if description is None else _str(description, f"{path}.description"),
                _schema(tool.get("input_schema"), f"{path}.input_schema"),
                _cache(tool, path, target))


def _anthropic_choice(chat: Chat, choice: dict[str, Any]) -> None:
    mode = choice.get("type")
    if mode not in ("auto", "any", "tool", "none"):
        raise malformed("tool_choice.type", "'auto', 'any', 'tool' or 'none'")
    name = _str(choice.get("name"), "tool_choice.name") if mode == "tool" else None
    chat.choice = Choice("tool_choice", mode, name)
    if choice.get("disable_parallel_tool_use") is True:
        chat.parallel, chat.paths["parallel"] = False, "tool_choice.disable_parallel_tool_use"


def _anthropic_texts(content: Any, path: str, target: str) -> list[Text]:
    out = []
    for block in _anthropic_blocks(content, path, target):
        if not isinstance(block, Text):
            raise cannot(path, "a block other than text here", target)
        out.append(block)
    return out


def _anthropic_blocks(content: Any, path: str, target: str, *, inner: bool = False
                      ) -> list[Text | Image | ToolCall | ToolResult]:
    """A message's content; `inner`: a tool_result's, which holds text and
    images only (so a nested body cannot recurse)."""
    if isinstance(content, str):
        return [Text(path, content)]
    out: list[Text | Image | ToolCall | ToolResult] = []
    for j, block in enumerate(_list(content, path)):
        where = f"{path}[{j}]"
        block = _map(block, where)
        kind = block.get("type")
        if block.get("citations"):
            raise cannot(f"{where}.citations", "citations", target)
        if kind == "text":
            out.append(Text(where, _str(block.get("text"), f"{where}.text"),
                            _cache(block, where, target)))
            continue
        _cache(block, where, target, allowed=False)
        if kind == "image":
            out.append(_anthropic_image(_map(block.get("source"), f"{where}.source"), where,
                                        target))
        elif inner and kind in ("tool_use", "tool_result"):
            raise cannot(f"{where}.type", f"{shown(kind)} inside a tool_result", target)
        elif kind == "tool_use":
            out.append(ToolCall(where, _str(block.get("id"), f"{where}.id"),
                                _str(block.get("name"), f"{where}.name"),
                                _map(block.get("input"), f"{where}.input")))
        elif kind == "tool_result":
            parts = _anthropic_blocks(block.get("content") or [], f"{where}.content", target,
                                      inner=True)
            out.append(ToolResult(where, _str(block.get("tool_use_id"), f"{where}.tool_use_id"),
                                  tuple(p for p in parts if isinstance(p, Text | Image)),
                                  block.get("is_error") is True))
        else:
            raise cannot(f"{where}.type", shown(kind), target)
    return out


def _anthropic_image(source: dict[str, Any], path: str, target: str) -> Image:
    kind = source.get("type")
    if kind == "base64":
        return Image(path, media_type=_str(source.get("media_type"), f"{path}.source.media_type"),
                     data=_str(source.get("data"), f"{path}.source.data"))
    if kind == "url":
        return Image(path, url=_str(source.get("url"), f"{path}.source.url"))
    raise cannot(f"{path}.source.type", shown(kind), target)

