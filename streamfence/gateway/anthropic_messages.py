"""A call's events as Anthropic's Messages wire (`POST /v1/messages`).

Contract (pure: no I/O, the gateway writes the bytes):
- `MessageStream(call_id, model, created=None).feed(event)` -> the SSE bytes
  for one daemon event (PROTOCOL §6), b"" when it maps to nothing yet. Every
  frame has `event: <type>` and `id: <the event's seq>`. `started` says
  whether any byte went out: while it is False, a failed or cancelled done is
  better answered as the HTTP error (http_errors.done_error +
  anthropic_error). Feeding the same events again gives the same bytes.
- `message(call_id, model, done, created=None)` -> the non-streaming `message`
  body of a completed or partial done. (`created` is accepted for symmetry
  with the OpenAI side; Anthropic's message has no timestamp.)
- The message id is `msg_<call_id>`, `model` the name the client asked for.

The stream, as Anthropic sends it:
- `message_start` (usage `input_tokens: 0`: the daemon knows the usage only
  at the done; `message_delta` carries it all, input tokens included, and the
  SDK takes them from there), sent with the first frame that has content.
- Blocks: a `content_block_start` when the kind of content changes (`text`,
  `thinking` with `signature: ""` — the daemon does not keep signatures, so a
  thinking block cannot be sent back to Anthropic), `content_block_delta`s
  (`text_delta`, `thinking_delta`), a `content_block_stop` before the next
  block or at the end. A retry (a delta of a new attempt, which comes only
  while nothing visible was delivered) closes the open block: the retried
  attempt's reasoning is a new thinking block after the voided one.
- Tool calls go out whole at the done, from `done.response.tool_calls`: a
  `tool_use` block (id, name, `input: {}`), one `input_json_delta` with the
  arguments, its stop. Streamed as they come, a retry (which re-streams tool
  calls without a `reset`) or a call cut mid-arguments would leave the SDK a
  tool_use the daemon voided.
- Whitespace-only text of an attempt waits for its first visible character
  (gateway/sse.py `AttemptGate`). Refusal text has no block in this wire: it
  is the `message_delta`'s `stop_details.explanation` (what the anthropic
  worker reads it from), with `stop_reason: "refusal"`. Notices are left out.
- The done: `message_delta` (stop_reason from finish_reason: stop -> end_turn,
  length -> max_tokens, tool_calls -> tool_use, content_filter -> refusal;
  Anthropic's own values pass; a partial call's "length" is max_tokens), then
  `message_stop`.
- A failed or cancelled done: `event: error` with Anthropic's error body, on
  which the SDK raises `anthropic.APIStatusError`. A `reset`, or a second
  attempt after visible text, ends the stream the same way ("the answer was
  restarted; retry the request") and everything after it is ignored. Any
  event after the done raises ValueError.
"""

from __future__ import annotations

from typing import Any

import orjson

from streamfence.gateway import http_errors
from streamfence.gateway.sse import RESTARTED, AttemptGate, SecondAnswer, StreamState, frame

_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
         "function_call": "tool_use", "content_filter": "refusal"}
_ANTHROPIC_STOP = frozenset({"end_turn", "max_tokens", "stop_sequence", "tool_use",
                             "pause_turn", "refusal", "model_context_window_exceeded"})
_DELTAS = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking")}
_BLOCKS = {"text": {"type": "text", "text": ""},
           "thinking": {"type": "thinking", "thinking": "", "signature": ""}}
_KEPT_USAGE = ("input_tokens", "output_tokens", "cache_creation_input_tokens",
               "cache_read_input_tokens", "server_tool_use", "service_tier")


def stop_reason(response: dict[str, Any]) -> str:
    """Anthropic's stop_reason for a done's response ("end_turn" when unknown;
    "refusal" for an answer with refusal text)."""
    reason = response.get("finish_reason")
    stop = str(reason) if reason in _ANTHROPIC_STOP else _STOP.get(str(reason), "end_turn")
    return "refusal" if response.get("refusal") and stop == "end_turn" else stop


def stop_details(refusal: str | None) -> dict[str, Any] | None:
    return {"type": "refusal", "category": None, "explanation": refusal} if refusal else None


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def anthropic_usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    """Anthropic's usage from a done's usage (any worker's). Anthropic counts
    input tokens without the cached ones, which are fields of their own."""
    usage = usage or {}
    if isinstance(usage.get("input_tokens"), int):  # the anthropic worker keeps the raw fields
        kept = {k: usage[k] for k in _KEPT_USAGE if usage.get(k) is not None}
        kept.setdefault("output_tokens", 0)
        return kept
    prompt, output = _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))
    out: dict[str, Any] = {"input_tokens": prompt, "output_tokens": output}
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if isinstance(cached, int):  # OpenAI's prompt_tokens include the cached ones
        out["input_tokens"] = max(0, prompt - cached)
        out["cache_read_input_tokens"] = cached
    for src, dst in (("cache_read_input_tokens", "cache_read_input_tokens"),
                     ("cache_write_input_tokens", "cache_creation_input_tokens")):
        if isinstance(usage.get(src), int):  # Bedrock's: apart from inputTokens already
            out[dst] = usage[src]
    return out


def tool_use_id(call_id: str, index: int, given: Any) -> str:
    """The tool call's id, or one made up for a provider that sent none."""
    return str(given) if given else f"toolu_{call_id}_{index}"


def tool_input(arguments: str | None) -> Any:
    """A tool call's arguments as the `input` object ({} for none). The daemon
    keeps only tool calls whose arguments parse."""
    if not arguments or not arguments.strip():
        return {}
    try:
        return orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return {}


class MessageStream:
    """One streamed message; see the module docstring."""

    __slots__ = ("_block", "_call_id", "_gate", "_index", "_model", "_opened", "_refusal",
                 "started", "state")

    def __init__(self, call_id: str, model: str, created: int | None = None) -> None:
        del created  # Anthropic's message has no timestamp
        self._call_id = call_id
        self._model = model
        self._gate = AttemptGate()
        self._block: str | None = None  # the open block's type
        self._index = 0  # the next block's index
        self._refusal: list[str] = []  # refusal pieces: the message_delta's stop_details
        self._opened = False  # message_start went out
        self.started = False  # any byte went out
        self.state = StreamState.OPEN

    def feed(self, event: dict[str, Any]) -> bytes:
        """The SSE bytes for one daemon event."""
        op = event.get("op")
        if self.state is StreamState.BROKEN:
            return b""
        if self.state is StreamState.ENDED:
            raise ValueError(f"message stream {self.state.value}: unexpected {op!r} event "
                             f"(seq {event.get('seq')})")
        seq = int(event["seq"])
        out: list[bytes] = []
        if op == "delta":
            self._delta(seq, event, out)
        elif op == "reset":
            self._error(seq, "answer_restarted", RESTARTED, None, StreamState.BROKEN, out)
        elif op == "done":
            self._done(seq, event, out)
        else:
            raise ValueError(f"message stream {self.state.value}: unexpected event op {op!r} "
                             f"(seq {seq})")
        self.started = self.started or bool(out)
        return b"".join(out)

    def _delta(self, seq: int, event: dict[str, Any], out: list[bytes]) -> None:
        try:
            retry = self._gate.on_attempt(int(event["attempt"]))
        except SecondAnswer:
            self._error(seq, "answer_restarted", RESTARTED, None, StreamState.BROKEN, out)
            return
        if retry:
            self._stop_block(seq, out)
        kind, data = event.get("kind"), event.get("data")
        if not isinstance(data, str) or not data:
            return  # tool calls (a map): at the done
        if kind == "reasoning":
            self._piece(seq, "thinking", data, out)
        elif kind in ("text", "refusal"):
            self._pieces(seq, self._gate.admit(str(kind), data), out)
        # notices, and kinds added later: not on this wire

    def _pieces(self, seq: int, pieces: list[tuple[str, str]], out: list[bytes]) -> None:
        for kind, piece in pieces:
            if kind == "refusal":
                self._refusal.append(piece)
            else:
                self._piece(seq, "text", piece, out)

    def _piece(self, seq: int, block: str, piece: str, out: list[bytes]) -> None:
        if self._block != block:
            self._stop_block(seq, out)
            self._start_block(seq, _BLOCKS[block], out)
            self._block = block
        delta_type, field = _DELTAS[block]
        out.append(frame(seq, {"type": "content_block_delta", "index": self._index - 1,
                               "delta": {"type": delta_type, field: piece}},
                         "content_block_delta"))

    def _start_block(self, seq: int, block: dict[str, Any], out: list[bytes]) -> None:
        self._message_start(seq, out)
        out.append(frame(seq, {"type": "content_block_start", "index": self._index,
                               "content_block": block}, "content_block_start"))
        self._index += 1

    def _stop_block(self, seq: int, out: list[bytes]) -> None:
        if self._block is not None:
            out.append(frame(seq, {"type": "content_block_stop", "index": self._index - 1},
                             "content_block_stop"))
            self._block = None

    def _message_start(self, seq: int, out: list[bytes]) -> None:
        if self._opened:
            return
        self._opened = True
        out.append(frame(seq, {"type": "message_start", "message": {
            "id": f"msg_{self._call_id}", "type": "message", "role": "assistant",
            "model": self._model, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0}}}, "message_start"))

    def _done(self, seq: int, done: dict[str, Any], out: list[bytes]) -> None:
        if done.get("status") not in ("completed", "partial"):
            code, message, provider = http_errors.done_error(done)
            self._error(seq, code, message, provider, StreamState.ENDED, out)
            return
        response = done["response"]
        self._pieces(seq, self._gate.release(), out)
        self._stop_block(seq, out)
        for i, call in enumerate(response.get("tool_calls") or ()):
            self._start_block(seq, {"type": "tool_use",
                                    "id": tool_use_id(self._call_id, i, call.get("id")),
                                    "name": call.get("name"), "input": {}}, out)
            if call.get("arguments"):
                out.append(frame(seq, {"type": "content_block_delta", "index": self._index - 1,
                                       "delta": {"type": "input_json_delta",
                                                 "partial_json": call["arguments"]}},
                                 "content_block_delta"))
            out.append(frame(seq, {"type": "content_block_stop", "index": self._index - 1},
                             "content_block_stop"))
        self._message_start(seq, out)
        refusal = "".join(self._refusal) or response.get("refusal")
        delta: dict[str, Any] = {"stop_reason": stop_reason({**response, "refusal": refusal}),
                 "stop_sequence": None}
        if refusal:
            delta["stop_details"] = stop_details(refusal)
        out.append(frame(seq, {"type": "message_delta", "delta": delta,
                               "usage": anthropic_usage(response.get("usage"))},
                         "message_delta"))
        out.append(frame(seq, {"type": "message_stop"}, "message_stop"))
        self.state = StreamState.ENDED

    def _error(self, seq: int, code: str, message: str,
               provider: http_errors.ProviderError | None,
               then: StreamState, out: list[bytes]) -> None:
        self.state = then
        out.append(frame(seq, http_errors.anthropic_error(code, message, provider)[1],
                         "error"))


def message(call_id: str, model: str, done: dict[str, Any],
            created: int | None = None) -> dict[str, Any]:
    """The `message` body of a completed or partial done. The done must hold
    its content (`content_omitted` false, as `Client.run()` returns it):
    ValueError otherwise, rather than an empty answer."""
    del created  # Anthropic's message has no timestamp
    response = done["response"]
    if done.get("status") not in ("completed", "partial"):
        raise ValueError(f"call {call_id} ended {done.get('status')}: it has no message")
    if response.get("content_omitted"):
        raise ValueError(f"call {call_id}: the done omits its content; assemble it from "
                         "the deltas (Client.run does) before rendering the message")
    content: list[dict[str, Any]] = []
    if response.get("reasoning"):
        content.append({"type": "thinking", "thinking": response["reasoning"], "signature": ""})
    if response.get("content"):
        content.append({"type": "text", "text": response["content"]})
    content.extend({"type": "tool_use", "id": tool_use_id(call_id, i, c.get("id")),
                    "name": c.get("name"), "input": tool_input(c.get("arguments"))}
                   for i, c in enumerate(response.get("tool_calls") or ()))
    return {"id": f"msg_{call_id}", "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop_reason(response), "stop_sequence": None,
            "stop_details": stop_details(response.get("refusal")),
            "usage": anthropic_usage(response.get("usage"))}
