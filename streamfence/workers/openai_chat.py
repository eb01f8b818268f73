"""OpenAI chat-completions adapter: raw SSE bytes -> protocol deltas + AttemptOutcome.

Contract:
- `ADAPTER`: this wire's `Adapter` (workers/adapter.py) for profile kind "openai".
- `ChatStreamAssembler(out)`: `feed(chunk_dict)` per decoded chunk, then `finish()`
  -> the AttemptOutcome. Pure, dict lookups only; slot bookkeeping and the outcome
  come from `streamfence.workers.assembly.ToolSlots`.
- `stream_chat(client, request, out)`: the SDK sends the request (auth; typed status
  errors raised on entering); we frame the body ourselves (`iter_sse_events` + orjson),
  skipping the SDK's per-chunk model construction. Whatever ends the attempt (a status
  error, a transport error mid-body, MalformedStreamError for a bad payload) is
  classified into the returned outcome, with the partial state (dropped tool calls)
  kept. A 400/422 naming `stream_options` is retried once without it, inside the same
  attempt, and the outcome says `stream_options_rejected`.
- `complete_chat(client, request, out)`: the non-streaming fall-back, fed through the
  same assembler as one chunk.

Rules (docs/ARCHITECTURE.md §4.6):
- Tool calls: a provider index reused with a new id opens a new slot; slots are numbered
  0, 1, 2 … in order of opening; integer ids are stringified; names are assigned, never
  appended; a slot is opened towards `out` once its name is known, with the arguments
  buffered so far.
- No finish_reason: nothing received -> `empty_stream`; the include_usage chunk arrived
  (the provider's own end-of-response accounting) -> finished; otherwise
  `no_finish_reason`. Any error drops every tool call.
- finish_reason set but a call's arguments are not JSON (or it never got a name): the
  call is dropped and finish_reason becomes "length" (truncated arguments) unless it is
  content_filter. No repair: fragments already left for the sink.
- finish_reason "error": the streamed text is the provider's error. Text that could be an
  SSE block or a JSON error is held back until judged, so it never counts as delivered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import openai
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
from streamfence.workers.error_text import names_stream_options
from streamfence.workers.errors import (
    MalformedStreamError,
    attempt_error,
    classify,
    classify_error_text,
)
from streamfence.workers.output import REASONING, REFUSAL, TEXT, TOOL_CALL, AttemptOutput

HOLD_LIMIT = 4096  # provider error text is held up to this many characters
_ERROR_FINISH = frozenset({"error", "error_finish"})
_FINISH_ALIASES = {"end_turn": "stop", "stop_sequence": "stop", "eos": "stop", "max_tokens": "length",
                   "tool_use": "tool_calls", "function_call": "tool_calls", "safety": "content_filter"}
_SSE_FIELDS = ("event", "data", "id", "retry")
_ERROR_JSON = '{"error"'
_SHAPE_ERRORS = (AttributeError, TypeError, KeyError, IndexError, ValueError)


def _transient(code: str, message: str) -> AttemptError:
    return attempt_error(ErrorClass.TRANSIENT, code, message)


def _may_be_error_block(text: str) -> bool:
    """True while text not yet shown could still be an SSE block or a JSON error."""
    s = text.lstrip()
    if not s:
        return True
    if s[0] == "{":
        head = "".join(s[:24].split())
        return head.startswith(_ERROR_JSON) or _ERROR_JSON.startswith(head)
    lines = s.split("\n")
    for i, line in enumerate(lines):
        line = line.rstrip("\r")
        if not line or line[0] == ":":
            continue
        name, sep, _ = line.partition(":")
        if sep and name.strip() in _SSE_FIELDS:
            continue
        if not sep and i == len(lines) - 1 and any(f.startswith(name) for f in _SSE_FIELDS):
            continue
        return False
    return True


class ChatStreamAssembler(ToolSlots):
    """Owns one chat-completions stream's assembly: chunk dicts in, deltas to `out`,
    and its finish reason, usage and held-back error text; see the module docstring."""

    __slots__ = (*ToolSlots.SLOTS, "_held", "_last_id_by_raw", "_text_head", "_text_sent",
                 "chunks", "finish_reason", "keepalives", "usage")

    def __init__(self, out: AttemptOutput) -> None:
        super().__init__(out)
        self._held = ""
        self._last_id_by_raw: dict[Any, str] = {}
        self._text_sent = False
        self._text_head = ""
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.keepalives = 0  # contentless SSE frames (the transport counts them)
        self.chunks = 0

    def feed(self, chunk: dict[str, Any]) -> None:
        if self.done:
            return
        try:
            self.chunks += 1
            if self.model is None and chunk.get("model"):
                self.model = str(chunk["model"])
            if self.response_id is None and isinstance(chunk.get("id"), str):
                self.response_id = chunk["id"] or None
            if chunk.get("error"):
                self.fail_payload(chunk)
                return
            usage = chunk.get("usage")
            if usage:
                self.usage = usage
            choices = chunk.get("choices")
            if not choices:
                self._choiceless(chunk)
                return
            choice = choices[0]
            finish = choice.get("finish_reason")
            if finish:
                finish = str(finish).lower()
                self.finish_reason = _FINISH_ALIASES.get(finish, finish)
            delta = choice.get("delta")
            if not delta:
                return
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning and type(reasoning) is str:
                self.saw_content = True
                self._delta(REASONING, reasoning)
            content = delta.get("content")
            if content:
                if type(content) is not str:
                    content = self._blocks(content)
                if content:
                    if self._text_sent:
                        self._delta(TEXT, content)
                    else:
                        self._first_text(content)
            refusal = delta.get("refusal")
            if refusal and type(refusal) is str:
                self.saw_content = True
                self._delta(REFUSAL, refusal)
            tool_calls = delta.get("tool_calls")
            if tool_calls:
                self.saw_content = True
                for tc in tool_calls:
                    self._tool(tc)
        except _SHAPE_ERRORS as exc:
            if raised_here(exc, __file__):
                raise MalformedStreamError(f"unexpected chunk shape ({type(exc).__name__}: {exc})") from exc
            raise

    def _choiceless(self, chunk: dict[str, Any]) -> None:
        # DeepInfra sends validation errors as choiceless chunks; Nous ends with lastOne.
        if chunk.get("error_type") or chunk.get("error_message"):
            self.fail_payload({"error": {"type": chunk.get("error_type"),
                                         "message": chunk.get("error_message")}})
        elif chunk.get("lastOne") in (True, 1, "true") and self.finish_reason is None:
            self.finish_reason = "stop"

    def _blocks(self, content: Any) -> str:
        """List-of-blocks content: text blocks are text, thinking blocks reasoning."""
        if isinstance(content, dict):
            content = [content]
        if not isinstance(content, list):
            return ""
        parts = []
        for block in content:
            if isinstance(block, str):
                parts.append(block)
                continue
            kind = block.get("type", "text")
            value = block.get("text") if kind != "thinking" else block.get("thinking") or block.get("text")
            if isinstance(value, list):
                value = self._blocks(value)
            if not isinstance(value, str) or not value:
                continue
            if kind in ("thinking", "reasoning"):
                self.saw_content = True
                self._delta(REASONING, value)
            elif kind in ("text", "output_text"):
                parts.append(value)
        return "".join(parts)

    def _first_text(self, content: str) -> None:
        self.saw_content = True
        held = self._held + content
        if len(held) <= HOLD_LIMIT and _may_be_error_block(held):
            self._held = held
            return
        self._held = ""
        self._text_sent = True
        self._text_head = held[:HOLD_LIMIT]
        self._delta(TEXT, held)

    def _tool(self, tc: dict[str, Any]) -> None:
        raw = tc.get("index")
        if raw is None:
            raw = 0
        tid = tc.get("id")
        if tid is not None and type(tid) is not str:
            tid = str(tid)  # Poolside sends integer ids
        slot = self._slot_by.get(raw)
        if tid:
            last = self._last_id_by_raw.get(raw)
            # Ollama-style batches reuse index 0 and tell calls apart only by id.
            if slot is None or (last is not None and tid != last):
                slot = self._new_slot(raw)
            self._last_id_by_raw[raw] = tid
            if self._ids[slot] is None:
                self._ids[slot] = tid
        elif slot is None:
            slot = self._new_slot(raw)
        fn = tc.get("function") or {}
        name = fn.get("name")
        args = fn.get("arguments")
        if args is not None and type(args) is not str:
            args = orjson.dumps(args).decode()  # some servers send an object
        if self._names[slot] is not None:  # open towards `out`
            if args:
                self._args[slot].append(args)
                self._delta(TOOL_CALL, {"index": slot, "id": None, "name": None, "arguments": args})
            return
        if args:
            self._args[slot].append(args)
        if name:
            self._name_slot(slot, name)

    def finish(self, error: AttemptError | None = None) -> AttemptOutcome:
        """The outcome. `error`: the classified exception that ended the attempt."""
        error = error or self.error
        finish = self.finish_reason
        if error is None and finish in _ERROR_FINISH:
            error = classify_error_text(self._held or self._text_head)
        elif error is None and finish is None:
            if not self.saw_content:
                error = (_transient("empty_sse_frames", "the stream carried only "
                                    f"{self.keepalives} contentless SSE frames")
                         if self.keepalives and not self.chunks else
                         _transient("empty_stream", "the provider returned an empty "
                                    "stream (no content, tool call or finish_reason)"))
            elif self.usage is not None:
                finish = "tool_calls" if self._names else "stop"
            else:
                error = _transient("no_finish_reason", "the stream ended without a "
                                   "finish_reason (incomplete response)")
        dropped, finish = self._settle(error, finish, self._named_json)
        if error is None and self._held:
            self._text_sent = True
            self._delta(TEXT, self._held)
            self._held = ""
        return self._final(error, finish, self.usage, dropped)


def stream_chat(client: openai.OpenAI, request: dict[str, Any], out: AttemptOutput, *,
                include_usage: bool = True, timeout: Any = None, secrets: Sequence[str] = ()
                ) -> AttemptOutcome:
    """Run one streaming attempt; return its outcome. See the module docstring."""
    kwargs = dict(request)
    kwargs.pop("stream_options", None)
    if include_usage:
        kwargs["stream_options"] = {**(request.get("stream_options") or {}), "include_usage": True}
    if timeout is not None:
        kwargs["timeout"] = timeout
    kwargs["stream"] = True
    asm = ChatStreamAssembler(out)
    chunk, feed, loads = out.chunk, asm.feed, orjson.loads
    try:
        with no_sdk_retries(client).chat.completions.with_streaming_response.create(**kwargs) as resp:
            events = sse_events(resp.http_response, out)
            if events is None:  # a whole completion
                body = resp.http_response.read()
                chunk(len(body))
                _feed_completion(asm, body)
                return asm.finish()
            for event, data in events:
                if data is None:
                    asm.keepalives += 1
                    continue
                try:
                    obj = loads(data)
                except orjson.JSONDecodeError:
                    if data.startswith(b"[DONE]"):
                        break
                    if not data.strip():
                        asm.keepalives += 1  # an empty data frame is a keep-alive, not a chunk
                        continue
                    chunk(len(data))
                    if event == b"error":
                        asm.fail_text(data.decode("utf-8", "replace"))
                        break
                    raise MalformedStreamError(f"SSE data is not JSON: {data[:200]!r}") from None
                chunk(len(data))
                if type(obj) is not dict:
                    raise MalformedStreamError(f"SSE data is not a JSON object: {data[:200]!r}")
                if event == b"error":
                    asm.fail_payload(obj)
                    break
                feed(obj)
                if asm.done:
                    break
    except Exception as exc:
        if include_usage and is_stream_options_rejection(exc):
            # Retried once without it, inside the same attempt (it does not spend the
            # retry budget); the supervisor remembers it for the profile.
            return replace(stream_chat(client, request, out, include_usage=False,
                                       timeout=timeout, secrets=secrets),
                           stream_options_rejected=True)
        error = classify(exc, secrets)
        if asm.finish_reason is not None and asm.error is None \
                and error.error_class is ErrorClass.TRANSIENT:
            return asm.finish()  # the finish chunk is proof enough; only the trailer was lost
        return asm.raised(exc, error)
    return asm.finish()


def _feed_completion(asm: ChatStreamAssembler, body: bytes) -> None:
    """Feed a non-streaming chat.completion body to the assembler as one chunk."""
    obj = json_body(body, "completion")
    choices = obj.get("choices")
    if obj.get("error") or not isinstance(choices, list) or not choices:
        asm.feed(obj)
        return
    first = choices[0] if isinstance(choices[0], dict) else {}
    message = first.get("message") or {}
    delta = dict(message) if isinstance(message, dict) else {}
    tool_calls = delta.get("tool_calls")
    if isinstance(tool_calls, list):
        delta["tool_calls"] = [{**tc, "index": i} for i, tc in enumerate(tool_calls) if isinstance(tc, dict)]
    # A complete body is complete: a missing finish_reason means the obvious one.
    finish = first.get("finish_reason") or ("tool_calls" if tool_calls else "stop")
    asm.feed({"id": obj.get("id"), "model": obj.get("model"), "usage": obj.get("usage"),
              "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def complete_chat(client: openai.OpenAI, request: dict[str, Any], out: AttemptOutput, *,
                  timeout: Any = None, secrets: Sequence[str] = ()) -> AttemptOutcome:
    """Non-streaming fall-back: one completion, delivered as deltas; its outcome."""
    kwargs = {k: v for k, v in request.items() if k not in ("stream", "stream_options")}
    if timeout is not None:
        kwargs["timeout"] = timeout
    return complete_body(
        lambda: no_sdk_retries(client).chat.completions.with_streaming_response.create(**kwargs),
        out, ChatStreamAssembler(out), _feed_completion, lambda exc: classify(exc, secrets))


def is_stream_options_rejection(exc: BaseException) -> bool:
    """A 400/422 naming stream_options: retry once without it (not a spent attempt)."""
    if not isinstance(exc, openai.APIStatusError):
        return False
    return names_stream_options(exc.status_code, f"{exc} {exc.body or ''}")


def make_client(profile: dict[str, Any]) -> openai.OpenAI:
    """The profile's client: shared SSL context, no env proxies, no SDK retries."""
    return openai.OpenAI(base_url=profile.get("base_url") or None, api_key=api_key_of(profile),
                         http_client=http_client(), max_retries=0)


def run(client: openai.OpenAI, request: dict[str, Any], out: AttemptOutput,
        settings: AttemptSettings, secrets: Sequence[str]) -> AttemptOutcome:
    """One attempt with the worker's socket timeouts, streamed unless the profile fell back."""
    timeout = openai.Timeout(connect=settings.connect_timeout_s, read=settings.read_timeout_s,
                             write=settings.write_timeout_s, pool=settings.connect_timeout_s)
    if not settings.streaming:
        return complete_chat(client, request, out, timeout=timeout, secrets=secrets)
    return stream_chat(client, request, out, include_usage=settings.include_usage,
                       timeout=timeout, secrets=secrets)


ADAPTER = Adapter(kind="openai", make_client=make_client, run=run, classify=classify)
