"""Anthropic Messages adapter: raw SSE bytes -> protocol deltas + AttemptOutcome.

Contract:
- `ADAPTER`: this wire's `Adapter` (workers/adapter.py) for profile kind "anthropic".
- `MessagesStreamAssembler(out)`: `feed(event_type, data)` per decoded event (its
  `type`: message_start, content_block_start/delta/stop, message_delta, message_stop,
  error), then `finish()` -> the AttemptOutcome. Pure, dict lookups only; a bad event
  shape raises MalformedStreamError. Slot bookkeeping and the outcome come from
  `streamfence.workers.assembly.ToolSlots`.
- `stream_messages(client, request, out)`: the SDK sends the request (auth, headers,
  typed status errors raised on entering); we frame the body ourselves
  (`streamfence.workers.sse.iter_sse_events` + orjson) and stop reading at
  `message_stop`. Whatever ends the attempt (a status error, a transport error mid-body)
  is classified into the returned outcome, with the partial state kept. `ping` events,
  SSE comments and data-less frames are not chunks: `out.chunk` is called once per
  other event.
- `complete_messages(client, request, out)`: the non-streaming fall-back; the whole
  message is replayed through the same assembler as synthetic events.
- `request` is the Messages body without `stream`: the SDK's named parameters go as
  keyword arguments, every other key (temperature, top_p, ...) in `extra_body`.

Rules (docs/ARCHITECTURE.md §4.6):
- text_delta -> text; thinking_delta -> reasoning; signature/citations deltas and
  redacted_thinking / server-tool blocks carry nothing to deliver.
- tool_use block -> a tool_call slot (slots 0, 1, 2 … in order of opening); its first
  fragment carries id + name (+ `input` when a proxy sends it whole), then every
  non-empty partial_json piece. A kept call with no arguments gets a final "{}" piece.
- `message_stop` is required. Without it: nothing seen -> `empty_stream` (only pings
  -> `empty_sse_frames`); else `no_finish_reason`. Any error drops every tool call.
- message_stop without a stop_reason: no content -> `empty_stream`; a tool_use block ->
  `no_finish_reason` (a mid-tool-call drop, retried, never executed); text only -> "stop".
- stop_reason: end_turn/stop_sequence -> "stop"; max_tokens and
  model_context_window_exceeded -> "length"; tool_use -> "tool_calls"; refusal ->
  "content_filter": every tool call is dropped (a refused turn runs no tool) and
  `stop_details.explanation`, when sent, becomes a `refusal` delta; other values pass.
- With a stop reason, a call whose block never stopped or whose arguments are not a
  JSON object is dropped and finish_reason becomes "length" (truncated arguments).
- usage: message_start's, updated by message_delta's (cumulative) fields, plus
  prompt_tokens = input + cache creation + cache read, completion_tokens = output.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import anthropic
import orjson

from streamfence.protocol.internal.outcome import AttemptError, AttemptOutcome, ErrorClass
from streamfence.protocol.internal.workers import AttemptSettings
from streamfence.workers.adapter import Adapter, api_key_of, http_client, no_sdk_retries
from streamfence.workers.assembly import (
    ToolSlots,
    complete_body,
    json_body,
    raised_here,
    sse_events,
)
from streamfence.workers.errors import MalformedStreamError, attempt_error, classify
from streamfence.workers.output import REASONING, REFUSAL, TEXT, TOOL_CALL, AttemptOutput

_STOP_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length",
                 "model_context_window_exceeded": "length", "tool_use": "tool_calls",
                 "refusal": "content_filter"}
_DELTA_FIELDS = {"text_delta": ("text", TEXT), "thinking_delta": ("thinking", REASONING)}
_BLOCK_FIELDS = {"text": ("text", TEXT), "thinking": ("thinking", REASONING)}
_SHAPE_ERRORS = (AttributeError, TypeError, KeyError, IndexError, ValueError)
_USAGE_IN = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")


def _transient(code: str, message: str) -> AttemptError:
    return attempt_error(ErrorClass.TRANSIENT, code, message)


class MessagesStreamAssembler(ToolSlots):
    """Owns one Messages stream's assembly: events in, deltas to `out`, and its stop
    reason, usage and open tool_use blocks; see the module docstring."""

    __slots__ = (*ToolSlots.SLOTS, "_open", "_usage", "chunks", "keepalives", "stop_details",
                 "stop_reason", "stopped")

    def __init__(self, out: AttemptOutput) -> None:
        super().__init__(out)  # `done` here: message_stop or an error ended the attempt
        self._open: list[bool] = []  # per slot: its tool_use block has not stopped yet
        self._usage: dict[str, Any] | None = None
        self.stop_reason: str | None = None  # as Anthropic named it
        self.stop_details: Any = None
        self.stopped = False  # message_stop seen
        self.keepalives = 0  # pings and data-less frames (the transport counts them)
        self.chunks = 0

    def feed(self, event_type: str, data: dict[str, Any]) -> None:
        if self.done:
            return
        try:
            self.chunks += 1
            if event_type == "content_block_delta":  # the hot path: one per token batch
                delta = data["delta"]
                kind = delta["type"]
                pair = _DELTA_FIELDS.get(kind)
                if pair is not None:
                    value = delta[pair[0]]
                    if type(value) is not str:
                        raise TypeError(f"{kind}.{pair[0]} is not a string")
                    if value:
                        self.saw_content = True
                        self._delta(pair[1], value)
                elif kind == "input_json_delta":
                    self._tool_piece(data["index"], delta["partial_json"])
                # signature_delta, citations_delta, unknown kinds: nothing to deliver
            elif event_type == "content_block_start":
                self.saw_content = True
                block = data["content_block"]
                kind = block["type"]
                if kind == "tool_use":
                    self._open_tool(data["index"], block)
                elif (pair := _BLOCK_FIELDS.get(kind)) is not None:
                    value = block.get(pair[0])  # "" when streamed; a whole block carries it
                    if value and type(value) is str:
                        self._delta(pair[1], value)
            elif event_type == "content_block_stop":
                slot = self._slot_by.get(data["index"])
                if slot is not None:
                    self._open[slot] = False
            elif event_type == "message_start":
                message = data["message"]
                if self.response_id is None and isinstance(message.get("id"), str):
                    self.response_id = message["id"] or None
                if self.model is None and isinstance(message.get("model"), str):
                    self.model = message["model"] or None
                self._add_usage(message.get("usage"))
            elif event_type == "message_delta":
                self._message_delta(data)
            elif event_type == "message_stop":
                self.stopped = self.done = True
            elif event_type == "error":
                self.fail_payload(data)
            # ping and event types added later: nothing to do
        except _SHAPE_ERRORS as exc:
            if raised_here(exc, __file__):
                raise MalformedStreamError(
                    f"unexpected {event_type} event shape ({type(exc).__name__}: {exc})") from exc
            raise

    def _open_tool(self, block_index: Any, block: dict[str, Any]) -> None:
        name = block["name"]
        if type(name) is not str or not name:
            raise ValueError("tool_use block without a name")
        tid = block.get("id")
        initial = block.get("input")
        if not initial:
            args = ""
        elif type(initial) is str:
            args = initial
        else:
            args = orjson.dumps(initial).decode()
        slot = self._new_slot(block_index, None if tid is None else str(tid), name)
        if args:
            self._args[slot].append(args)
        self._open.append(True)
        self._name_slot(slot, name)

    def _tool_piece(self, block_index: Any, piece: Any) -> None:
        slot = self._slot_by.get(block_index)
        if slot is None or not self._open[slot]:
            raise ValueError(f"unexpected event order: input_json_delta for block "
                             f"{block_index!r}, which is not an open tool_use block")
        if type(piece) is not str:
            raise TypeError("input_json_delta.partial_json is not a string")
        if piece:
            self._args[slot].append(piece)
            self._delta(TOOL_CALL, {"index": slot, "id": None, "name": None, "arguments": piece})

    def _message_delta(self, data: dict[str, Any]) -> None:
        delta = data.get("delta") or {}
        reason = delta.get("stop_reason")
        if reason:
            self.stop_reason = str(reason)
            details = delta.get("stop_details")
            self.stop_details = details
            if reason == "refusal" and isinstance(details, dict):
                explanation = details.get("explanation")
                if isinstance(explanation, str) and explanation:
                    self._delta(REFUSAL, explanation)
        self._add_usage(data.get("usage"))

    def _add_usage(self, usage: Any) -> None:
        if usage:
            if self._usage is None:
                self._usage = {}
            self._usage.update((k, v) for k, v in usage.items() if v is not None)

    def usage(self) -> dict[str, Any] | None:
        """The raw usage fields plus prompt/completion/total tokens."""
        raw = self._usage
        if raw is None:
            return None
        prompt = sum(v for v in (raw.get(k) for k in _USAGE_IN) if type(v) is int)
        output = raw.get("output_tokens")
        completion = output if type(output) is int else 0
        return {**raw, "prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def finish(self, error: AttemptError | None = None) -> AttemptOutcome:
        """The outcome. `error`: the classified exception that ended the attempt."""
        error = error or self.error
        reason = self.stop_reason
        finish = _STOP_REASONS.get(reason, reason) if reason else None
        if error is None and not self.stopped:
            if self.saw_content:
                error = _transient("no_finish_reason", "the stream ended before message_stop "
                                   "(incomplete response)")
            elif self.keepalives and not self.chunks:
                error = _transient("empty_sse_frames", f"the stream carried only "
                                   f"{self.keepalives} pings or contentless SSE frames")
            else:
                error = _transient("empty_stream", "the provider returned an empty stream "
                                   "(no content and no message_stop)")
        elif error is None and finish is None:
            if not self.saw_content:
                error = _transient("empty_stream", "the provider returned an empty message "
                                   "(no content and no stop_reason)")
            elif self._names:
                error = _transient("no_finish_reason", "message_stop without a stop_reason "
                                   "while a tool_use block was open: a mid-tool-call drop")
            else:
                finish = "stop"
        refused = finish == "content_filter"  # a refused turn runs no tool: drop them all
        dropped, finish = self._settle(error, finish, lambda s: not refused and self._complete(s))
        if error is None:
            for s in range(len(self._names)):
                if s not in dropped and not self._args[s]:
                    self._args[s].append("{}")
                    self._delta(TOOL_CALL, {"index": s, "id": None, "name": None,
                                            "arguments": "{}"})
        return self._final(error, finish, self.usage(), dropped)

    def _complete(self, slot: int) -> bool:
        # A block that never stopped may have its input cut short; no input at all is "{}".
        return not self._open[slot] and self._args_ok(slot, want_object=True)


# Body fields the SDK names as keyword parameters (not its request options).
_SDK_PARAMS = frozenset(inspect.signature(anthropic.resources.messages.Messages.create).parameters) \
    - {"self", "stream", "extra_headers", "extra_query", "extra_body", "timeout"}


def _create_kwargs(request: dict[str, Any], timeout: Any) -> dict[str, Any]:
    """Named SDK parameters as keywords, every other body key in `extra_body`."""
    kwargs: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in request.items():
        if key in _SDK_PARAMS:
            kwargs[key] = value
        elif key != "stream":
            extra[key] = value
    if extra:
        kwargs["extra_body"] = extra
    if timeout is not None:
        kwargs["timeout"] = timeout
    return kwargs


def stream_messages(client: anthropic.Anthropic, request: dict[str, Any], out: AttemptOutput,
                    *, timeout: Any = None, secrets: Sequence[str] = ()) -> AttemptOutcome:
    """Run one streaming attempt; return its outcome. See the module docstring."""
    kwargs = _create_kwargs(request, timeout)
    kwargs["stream"] = True
    asm = MessagesStreamAssembler(out)
    chunk, feed, loads = out.chunk, asm.feed, orjson.loads
    try:
        with no_sdk_retries(client).messages.with_streaming_response.create(**kwargs) as resp:
            events = sse_events(resp.http_response, out)
            if events is None:  # a whole message
                body = resp.http_response.read()
                chunk(len(body))
                _feed_message(asm, body)
                return asm.finish()
            for event, data in events:
                if data is None or event == b"ping":
                    asm.keepalives += 1
                    continue
                try:
                    obj = loads(data)
                except orjson.JSONDecodeError:
                    if not data.strip():
                        asm.keepalives += 1  # an empty data frame is a keep-alive, not a chunk
                        continue
                    chunk(len(data))
                    if event == b"error":
                        asm.fail_text(data.decode("utf-8", "replace"))
                        break
                    raise MalformedStreamError(f"SSE data is not JSON: {data[:200]!r}") from None
                if type(obj) is not dict:
                    chunk(len(data))
                    raise MalformedStreamError(f"SSE data is not a JSON object: {data[:200]!r}")
                etype = obj.get("type")
                if etype == "ping":
                    asm.keepalives += 1
                    continue
                chunk(len(data))
                if event == b"error" or etype == "error":
                    asm.fail_payload(obj)
                    break
                if type(etype) is not str:
                    etype = event.decode("utf-8", "replace") if event else ""
                feed(etype, obj)
                if asm.done:
                    break
    except Exception as exc:
        return asm.raised(exc, classify(exc, secrets))
    return asm.finish()


def _feed_message(asm: MessagesStreamAssembler, body: bytes) -> None:
    """Replay a non-streaming Message body through the assembler as events."""
    obj = json_body(body, "message")
    if obj.get("type") == "error" or "error" in obj:
        asm.fail_payload(obj)
        return
    content = obj.get("content")
    if not isinstance(content, list):
        raise MalformedStreamError("message body has no content list")
    feed = asm.feed
    feed("message_start", {"message": {"id": obj.get("id"), "model": obj.get("model"),
                                       "usage": obj.get("usage")}})
    for i, block in enumerate(content):  # a whole block delivers its text / input at start
        feed("content_block_start", {"index": i, "content_block": block})
        feed("content_block_stop", {"index": i})
    feed("message_delta", {"delta": {"stop_reason": obj.get("stop_reason"),
                                     "stop_details": obj.get("stop_details")}})
    feed("message_stop", {})


def complete_messages(client: anthropic.Anthropic, request: dict[str, Any], out: AttemptOutput,
                      *, timeout: Any = None, secrets: Sequence[str] = ()) -> AttemptOutcome:
    """Non-streaming fall-back: one message, delivered as deltas; its outcome."""
    # An explicit timeout also keeps the SDK from refusing a large max_tokens unstreamed.
    kwargs = _create_kwargs(request, timeout if timeout is not None else client.timeout)
    return complete_body(
        lambda: no_sdk_retries(client).messages.with_streaming_response.create(**kwargs),
        out, MessagesStreamAssembler(out), _feed_message, lambda exc: classify(exc, secrets))


def _base_url(profile: dict[str, Any]) -> str:
    # The SDK appends /v1/messages; accept a base_url given with the /v1 as well.
    url = str(profile.get("base_url") or "https://api.anthropic.com").rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def make_client(profile: dict[str, Any]) -> anthropic.Anthropic:
    """The profile's client: shared SSL context, no env proxies, no SDK retries."""
    # An explicit api_key (and base_url) keeps the SDK from reading ANTHROPIC_* credentials.
    return anthropic.Anthropic(base_url=_base_url(profile), api_key=api_key_of(profile),
                               http_client=http_client(), max_retries=0)


def run(client: anthropic.Anthropic, request: dict[str, Any], out: AttemptOutput,
        settings: AttemptSettings, secrets: Sequence[str]) -> AttemptOutcome:
    """One attempt with the worker's socket timeouts, streamed unless the profile fell back."""
    timeout = anthropic.Timeout(connect=settings.connect_timeout_s, read=settings.read_timeout_s,
                                write=settings.write_timeout_s, pool=settings.connect_timeout_s)
    if not settings.streaming:
        return complete_messages(client, request, out, timeout=timeout, secrets=secrets)
    return stream_messages(client, request, out, timeout=timeout, secrets=secrets)


ADAPTER = Adapter(kind="anthropic", make_client=make_client, run=run, classify=classify)
