"""A call's events as OpenAI's chat completions wire (`POST /v1/chat/completions`).

Contract (pure: no I/O, the gateway writes the bytes):
- `ChatCompletionStream(call_id, model, include_usage, created=None).feed(event)`
  -> the SSE bytes for one daemon event (PROTOCOL §6), b"" when it maps to
  nothing yet. Every frame has `id: <the event's seq>`. `started` says whether
  any byte went out: while it is False, a failed or cancelled done is better
  answered as the HTTP error (http_errors.done_error + openai_error), which is
  what the provider would have sent.
- `completion(call_id, model, done, created=None)` -> the non-streaming
  `chat.completion` body of a completed or partial done.
- The response id is `chatcmpl-<call_id>`, `model` the name the client asked
  for, `created` the Unix time (pass the same value to re-render the same
  bytes: feeding a call's events again from seq 1 gives the same frames, so a
  reconnect with Last-Event-ID can be served by re-feeding and skipping the
  frames with ids up to it).

The stream, as OpenAI sends it:
- `chat.completion.chunk`s with `choices[0].delta`: `content` for text,
  `refusal` for refusal; the first chunk also has `role: "assistant"`; with
  `include_usage` every chunk has `usage: null`.
- Tool calls go out whole at the done, from `done.response.tool_calls`, in
  OpenAI's streaming shape (a chunk with index, id, type "function" and name
  and `arguments: ""`, then one with the arguments). Streaming the fragments
  as they come would show the SDK calls the daemon later voids: a retry
  re-streams tool calls from the start without a `reset` (only visible text
  ends retries), and a call cut mid-arguments is dropped from the response.
- Whitespace-only text of an attempt waits for its first visible character
  (gateway/sse.py `AttemptGate`), so a retry never duplicates it.
- Reasoning and notices are left out: OpenAI's chat completions does not
  stream reasoning, and the openai SDK's ChoiceDelta has no field for it.
- A completed or partial done: the chunk with `finish_reason` (a partial
  call's is "length"; Anthropic's or Bedrock's own values are mapped to
  OpenAI's), with `include_usage` the usage chunk (`choices: []`), then
  `data: [DONE]`.
- A failed or cancelled done: the error chunk (`{"error": {...}}`, on which
  the SDK raises `openai.APIError`), no [DONE]. A `reset`, or a second
  attempt after visible text, ends the stream the same way ("the answer was
  restarted; retry the request") and everything after it is ignored: the
  gateway runs HTTP calls with `on_partial: "continue"`, so it should not
  happen. Any event after the done raises ValueError.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from streamfence.gateway import http_errors
from streamfence.gateway.sse import RESTARTED, AttemptGate, SecondAnswer, StreamState, frame

_FIELDS = {"text": "content", "refusal": "refusal"}
# finish reasons the workers pass through (Anthropic's, Bedrock's) -> OpenAI's
_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length",
           "model_context_window_exceeded": "length", "pause_turn": "length",
           "tool_use": "tool_calls", "refusal": "content_filter",
           "guardrail_intervened": "content_filter", "content_filtered": "content_filter"}
_OPENAI_FINISH = frozenset({"stop", "length", "tool_calls", "content_filter", "function_call"})
_USAGE_KEYS = ("prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details",
               "completion_tokens_details")


def finish_reason(response: dict[str, Any]) -> str:
    """OpenAI's finish_reason for a done's response ("stop" when unknown)."""
    reason = response.get("finish_reason")
    if reason in _OPENAI_FINISH:
        return str(reason)
    return _FINISH.get(str(reason), "stop")


def openai_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI's usage object from a done's usage (any worker's: each one fills
    prompt/completion/total tokens; cache reads become prompt_tokens_details)."""
    if not usage:
        return None
    out = {k: usage[k] for k in _USAGE_KEYS if usage.get(k) is not None}
    prompt, completion = out.setdefault("prompt_tokens", 0), out.setdefault("completion_tokens", 0)
    if "total_tokens" not in out and isinstance(prompt, int) and isinstance(completion, int):
        out["total_tokens"] = prompt + completion
    cached = usage.get("cache_read_input_tokens")
    if "prompt_tokens_details" not in out and isinstance(cached, int):
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def tool_call_id(call_id: str, index: int, given: Any) -> str:
    """The tool call's id, or one made up for a provider that sent none."""
    return str(given) if given else f"call_{call_id}_{index}"


class ChatCompletionStream:
    """One streamed chat completion; see the module docstring."""

    __slots__ = ("_base", "_call_id", "_gate", "_heads", "_include_usage", "_role_sent",
                 "_tail", "started", "state")

    def __init__(self, call_id: str, model: str, include_usage: bool,
                 created: int | None = None) -> None:
        self._call_id = call_id
        self._base = {"id": f"chatcmpl-{call_id}", "object": "chat.completion.chunk",
                      "created": int(time.time()) if created is None else created,
                      "model": model}
        self._include_usage = include_usage
        # A text or refusal piece's chunk after the first is these bytes around the
        # piece's JSON (what `_chunk` would encode, built once: the per-delta path).
        head = b"data: " + orjson.dumps(self._base)[:-1] + b',"choices":[{"index":0,"delta":{'
        self._heads = {kind: head + orjson.dumps(field) + b":" for kind, field in _FIELDS.items()}
        self._tail = (b'},"logprobs":null,"finish_reason":null}]'
                      + (b',"usage":null}' if include_usage else b"}") + b"\n\n")
        self._gate = AttemptGate()
        self._role_sent = False
        self.started = False
        self.state = StreamState.OPEN

    def feed(self, event: dict[str, Any]) -> bytes:
        """The SSE bytes for one daemon event."""
        op = event.get("op")
        if self.state is StreamState.BROKEN:
            return b""
        if self.state is StreamState.ENDED:
            raise ValueError(f"chat completion stream {self.state.value}: unexpected {op!r} "
                             f"event (seq {event.get('seq')})")
        seq = int(event["seq"])
        if op == "delta":
            out = self._delta(seq, event)
        elif op == "reset":
            out = self._error(seq, "answer_restarted", RESTARTED, None, StreamState.BROKEN)
        elif op == "done":
            out = self._done(seq, event)
        else:
            raise ValueError(f"chat completion stream {self.state.value}: unexpected event "
                             f"op {op!r} (seq {seq})")
        self.started = self.started or bool(out)
        return out

    def _delta(self, seq: int, event: dict[str, Any]) -> bytes:
        try:
            self._gate.on_attempt(int(event["attempt"]))
        except SecondAnswer:
            return self._error(seq, "answer_restarted", RESTARTED, None, StreamState.BROKEN)
        kind, data = event.get("kind"), event.get("data")
        if kind not in _FIELDS or not isinstance(data, str):
            return b""  # reasoning, notice: not on this wire; tool calls: at the done
        pieces = self._gate.admit(str(kind), data)
        if not self._role_sent:
            return b"".join(self._chunk(seq, {_FIELDS[k]: piece}) for k, piece in pieces)
        heads, tail = self._heads, self._tail
        return b"".join(b"id: %d\n%s%s%s" % (seq, heads[k], orjson.dumps(piece), tail)
                        for k, piece in pieces)

    def _done(self, seq: int, done: dict[str, Any]) -> bytes:
        status = done.get("status")
        if status not in ("completed", "partial"):
            code, message, provider = http_errors.done_error(done)
            return self._error(seq, code, message, provider, StreamState.ENDED)
        response = done["response"]
        out = [self._chunk(seq, {_FIELDS[k]: piece}) for k, piece in self._gate.release()]
        for i, call in enumerate(response.get("tool_calls") or ()):
            head = {"index": i, "id": tool_call_id(self._call_id, i, call.get("id")),
                    "type": "function", "function": {"name": call.get("name"), "arguments": ""}}
            out.append(self._chunk(seq, {"content": None, "tool_calls": [head]}
                                   if not self._role_sent else {"tool_calls": [head]}))
            if call.get("arguments"):
                out.append(self._chunk(seq, {"tool_calls": [
                    {"index": i, "function": {"arguments": call["arguments"]}}]}))
        if not self._role_sent:
            out.append(self._chunk(seq, {"content": ""}))
        out.append(self._chunk(seq, {}, finish_reason(response)))
        if self._include_usage:
            out.append(frame(seq, {**self._base, "choices": [],
                                   "usage": openai_usage(response.get("usage"))}))
        out.append(frame(seq, b"[DONE]"))
        self.state = StreamState.ENDED
        return b"".join(out)

    def _chunk(self, seq: int, delta: dict[str, Any], finish: str | None = None) -> bytes:
        if not self._role_sent:
            delta = {"role": "assistant", **delta}
            self._role_sent = True
        chunk: dict[str, Any] = {**self._base, "choices": [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if self._include_usage:
            chunk["usage"] = None
        return frame(seq, chunk)

    def _error(self, seq: int, code: str, message: str,
               provider: http_errors.ProviderError | None,
               then: StreamState) -> bytes:
        self.state = then
        return frame(seq, http_errors.openai_error(code, message, provider)[1])


def completion(call_id: str, model: str, done: dict[str, Any],
               created: int | None = None) -> dict[str, Any]:
    """The `chat.completion` body of a completed or partial done. The done must
    hold its content (`content_omitted` false, as `Client.run()` returns it):
    ValueError otherwise, rather than an empty answer."""
    response = done["response"]
    if done.get("status") not in ("completed", "partial"):
        raise ValueError(f"call {call_id} ended {done.get('status')}: it has no completion")
    if response.get("content_omitted"):
        raise ValueError(f"call {call_id}: the done omits its content; assemble it from "
                         "the deltas (Client.run does) before rendering the completion")
    content = response.get("content") or ""
    refusal = response.get("refusal")
    calls = [{"id": tool_call_id(call_id, i, c.get("id")), "type": "function",
              "function": {"name": c.get("name"), "arguments": c.get("arguments") or ""}}
             for i, c in enumerate(response.get("tool_calls") or ())]
    message: dict[str, Any] = {"role": "assistant",
                               "content": content or (None if calls or refusal else ""),
                               "refusal": refusal or None, "annotations": []}
    if calls:
        message["tool_calls"] = calls
    body: dict[str, Any] = {
        "id": f"chatcmpl-{call_id}", "object": "chat.completion",
        "created": int(time.time()) if created is None else created, "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": finish_reason(response)}]}
    usage = openai_usage(response.get("usage"))
    if usage is not None:
        body["usage"] = usage
    return body
