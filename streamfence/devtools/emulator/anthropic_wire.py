"""Anthropic Messages on the wire: ``POST /v1/messages``.

Contract
--------
* Streaming (``"stream": true``): ``text/event-stream`` of named events, each
  ``event: NAME\\ndata: {json}\\n\\n`` as Anthropic sends them:
  ``message_start`` (``message``: id, type, role, model, ``content: []``,
  ``stop_reason: null``, ``stop_sequence: null``, ``usage``: input_tokens,
  output_tokens), then per content block ``content_block_start`` /
  ``content_block_delta``... / ``content_block_stop``, then ``message_delta``
  (``delta.stop_reason``, ``usage.output_tokens``) and ``message_stop``.
  Blocks, in this order and numbered from 0: a ``thinking`` block (when
  ``reasoning`` is scripted: ``thinking_delta`` pieces, then one
  ``signature_delta``), a ``text`` block (``text_delta`` pieces; none when the
  text is empty), a ``tool_use`` block (id ``toolu_emu_<n>_0``, name,
  ``input: {}``; the arguments as ``input_json_delta`` ``partial_json``
  pieces, sent verbatim, so a script may send truncated JSON).
* Every event except ``ping`` is a data chunk: ``after``, ``chunks_sent`` and
  ``chunk_delay_s`` count ``message_start`` and the block start/stop events
  too (plain text with ``chunks=8``: message_start, block start, 8 deltas,
  block stop, message_delta, message_stop = 13 chunks; text piece k is chunk
  k + 2). No ping follows message_start (so ``keepalives_sent`` counts every
  ping written).
* ``stop_reason``: ``end_turn``, or ``tool_use`` with a tool call, or
  ``refusal`` when ``refusal`` is scripted (its text becomes
  ``delta.stop_details.explanation``; Anthropic streams no refusal text).
  ``finish_reason`` overrides it; OpenAI names are mapped (stop -> end_turn,
  length -> max_tokens, tool_calls -> tool_use, content_filter -> refusal),
  any other value is sent verbatim.
* Faults (applied by :func:`streamfence.devtools.emulator.stream.play`): ``no_finish`` omits
  ``message_delta`` and ``message_stop``; ``keepalive`` sends
  ``event: ping`` events (``data: {"type": "ping"}``); ``error_event`` sends
  ``event: error`` with ``{"type": "error", "error": {"type":
  error_type or "overloaded_error", "message": ...}}``; ``malformed`` an
  ``event: content_block_delta`` whose data is not JSON; ``empty`` a 200
  event stream with no event at all (a stream of only ``message_start``:
  script ``no_finish`` with ``"text": ""``); ``stall`` / ``disconnect`` as
  for every wire.
* Non-streaming: the ``message`` JSON (content blocks as above; a tool_use
  ``input`` is the parsed arguments, or the raw string when they are not a
  JSON object). Faults there as on the OpenAI wire: ``stall`` and
  ``keepalive`` wait ``stall_s``; ``disconnect`` aborts before any byte;
  ``no_finish`` gives ``stop_reason: null``; ``malformed`` a 200 with an
  undecodable body; ``empty`` a 200 with an empty body; ``error_event`` a
  200 whose body is the error object.
* ``status`` (either mode): that HTTP status with Anthropic's error body
  ``{"type": "error", "error": {"type", "message"}, "request_id"}`` (type by
  status: invalid_request_error, authentication_error, permission_error,
  not_found_error, request_too_large, rate_limit_error, api_error,
  overloaded_error for 529) and ``Retry-After`` when scripted.
* A body that is not a JSON object with a string ``model``, a list
  ``messages`` and an integer ``max_tokens`` gets a 400
  ``invalid_request_error`` (logged, consumes no step). With
  ``--require-auth`` a request without ``x-api-key`` (or a bearer token)
  gets 401 ``authentication_error``. ``auth_present`` in the log means either.
* The script key is the model's ``#KEY`` suffix or the ``X-Emu-Key`` header;
  the log record is kept exactly as for the OpenAI wire (``text``,
  ``reasoning_text``, ``refusal``, ``tool_call``, ``sent_text`` = the
  ``text_delta`` pieces written). Every response carries ``request-id`` and
  ``x-request-id``: ``req_emu_<n>``.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from aiohttp import web

from .script import Fault, Step, default_reasoning, default_text, split_model_key, split_text
from .state import RequestRecord
from .stream import (
    Chunk,
    StreamPlan,
    answer_stream,
    answer_whole,
    logged,
    open_record,
    refusal,
    take_step,
)

logger = logging.getLogger("streamfence.devtools.emulator.anthropic")

_ERROR_TYPES: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "Invalid request (emulated)."),
    401: ("authentication_error", "invalid x-api-key (emulated)"),
    403: ("permission_error", "Your API key does not have permission (emulated)."),
    404: ("not_found_error", "The requested resource could not be found (emulated)."),
    413: ("request_too_large", "Request exceeds the maximum allowed size (emulated)."),
    429: ("rate_limit_error", "Number of requests has exceeded your rate limit (emulated)."),
    500: ("api_error", "Internal server error (emulated)."),
    529: ("overloaded_error", "Overloaded (emulated)."),
}
_STOP_ALIASES = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                 "content_filter": "refusal"}
_SIGNATURE = "RW11bGF0ZWQgc2lnbmF0dXJl"  # opaque, as Anthropic's is


def _event(name: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def _error_object(status: int, step: Step | None, message: str | None = None) -> dict[str, Any]:
    etype, default = _ERROR_TYPES.get(
        status, ("api_error", f"Error {status} (emulated).") if status >= 500
        else ("invalid_request_error", f"Error {status} (emulated).")
    )
    return {"type": (step.error_type if step else None) or etype,
            "message": message or (step.message if step else None) or default}


def _json_response(status: int, payload: bytes, n: int,
                   extra: dict[str, str] | None = None) -> web.Response:
    headers = {"request-id": f"req_emu_{n}", "x-request-id": f"req_emu_{n}", **(extra or {})}
    return web.Response(status=status, body=payload, content_type="application/json",
                        headers=headers)


def _error_response(status: int, n: int, step: Step | None, message: str | None = None,
                    extra: dict[str, str] | None = None) -> web.Response:
    body = {"type": "error", "error": _error_object(status, step, message),
            "request_id": f"req_emu_{n}"}
    return _json_response(status, orjson.dumps(body), n, extra)


def _auth_present(request: web.Request) -> bool:
    if request.headers.get("x-api-key", "").strip():
        return True
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and bool(token.strip())


def _input_tokens(body: dict[str, Any]) -> int:
    chars = len(str(body.get("system") or ""))
    for message in body.get("messages") or ():
        if isinstance(message, dict):
            chars += len(str(message.get("content") or ""))
    return max(1, chars // 4)


def _stream_error(step: Step) -> dict[str, Any]:
    return {"type": "error", "error": {"type": step.error_type or "overloaded_error",
                                       "message": step.message or "Overloaded (emulated)."}}


class _Message:
    """The scripted content of one response, before it is framed."""

    def __init__(self, record: RequestRecord, step: Step, body: dict[str, Any]):
        n = record.n
        self.text = (step.text if step.text is not None
                     else ("" if step.tool_call else default_text(n, record.key, step.chunks)))
        if step.reasoning is True:
            self.reasoning = default_reasoning(n, step.chunks)
        else:
            self.reasoning = step.reasoning or ""
        self.refusal = step.refusal or ""
        self.tool_call = step.tool_call
        self.tool_id = f"toolu_emu_{n}_0"
        if step.finish_reason:
            self.stop_reason = _STOP_ALIASES.get(step.finish_reason, step.finish_reason)
        else:
            self.stop_reason = ("refusal" if self.refusal
                                else "tool_use" if step.tool_call else "end_turn")
        self.thinking_pieces = split_text(self.reasoning, step.chunks)
        self.text_pieces = split_text(self.text, step.chunks)
        self.arg_pieces = split_text(step.tool_call.arguments, step.chunks) if step.tool_call else []
        self.input_tokens = _input_tokens(body)
        self.output_tokens = (len(self.thinking_pieces) + len(self.text_pieces)
                              + len(self.arg_pieces))
        self.id = f"msg_emu{n}"
        self.model = record.model
        record.usage = {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens}
        record.text = self.text
        record.reasoning_text = self.reasoning
        record.refusal = self.refusal
        if step.tool_call:
            record.tool_call = {"id": self.tool_id, "name": step.tool_call.name,
                                "arguments": step.tool_call.arguments}

    def _stop_details(self) -> dict[str, Any] | None:
        if self.stop_reason != "refusal":
            return None
        return {"type": "refusal", "category": None, "explanation": self.refusal or None}

    def plan(self, step: Step) -> StreamPlan:
        start = {"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 1}}}
        body = [Chunk(_event("message_start", start))]
        index = 0
        if self.thinking_pieces:
            body += self._block(index, {"type": "thinking", "thinking": "", "signature": ""},
                                "thinking_delta", "thinking", self.thinking_pieces, text=False)
            body.insert(-1, Chunk(_event("content_block_delta", {
                "type": "content_block_delta", "index": index,
                "delta": {"type": "signature_delta", "signature": _SIGNATURE}})))
            index += 1
        if self.text_pieces:
            body += self._block(index, {"type": "text", "text": ""}, "text_delta", "text",
                                self.text_pieces, text=True)
            index += 1
        if self.tool_call:
            block = {"type": "tool_use", "id": self.tool_id, "name": self.tool_call.name,
                     "input": {}}
            body += self._block(index, block, "input_json_delta", "partial_json",
                                self.arg_pieces, text=False)
        delta = {"type": "message_delta",
                 "delta": {"stop_reason": self.stop_reason, "stop_sequence": None,
                           "stop_details": self._stop_details()},
                 "usage": {"output_tokens": self.output_tokens}}
        tail = [Chunk(_event("message_delta", delta)),
                Chunk(_event("message_stop", {"type": "message_stop"}))]
        return StreamPlan(
            body=body,
            tail=tail,
            done=b"",
            keepalive=_event("ping", {"type": "ping"}),
            malformed=b"event: content_block_delta\ndata: {not json\n\n",
            error_event=_event("error", _stream_error(step)),
        )

    @staticmethod
    def _block(index: int, start: dict[str, Any], delta_type: str, field: str,
               pieces: list[str], *, text: bool) -> list[Chunk]:
        chunks = [Chunk(_event("content_block_start", {
            "type": "content_block_start", "index": index, "content_block": start}))]
        # Every delta of a block shares its framing: only the piece is encoded per chunk.
        prefix = (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":'
                  + str(index).encode() + b',"delta":{"type":"' + delta_type.encode()
                  + b'","' + field.encode() + b'":')
        for piece in pieces:
            chunks.append(Chunk(prefix + orjson.dumps(piece) + b"}}\n\n", piece if text else ""))
        chunks.append(Chunk(_event("content_block_stop",
                                   {"type": "content_block_stop", "index": index})))
        return chunks

    def message(self, finish: bool) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if self.reasoning:
            content.append({"type": "thinking", "thinking": self.reasoning,
                            "signature": _SIGNATURE})
        if self.text:
            content.append({"type": "text", "text": self.text})
        if self.tool_call:
            try:
                parsed: Any = orjson.loads(self.tool_call.arguments)
            except orjson.JSONDecodeError:
                parsed = None
            tool_input = parsed if isinstance(parsed, dict) else self.tool_call.arguments
            content.append({"type": "tool_use", "id": self.tool_id,
                            "name": self.tool_call.name, "input": tool_input})
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": self.stop_reason if finish else None,
                "stop_sequence": None, "stop_details": self._stop_details() if finish else None,
                "usage": {"input_tokens": self.input_tokens,
                          "output_tokens": self.output_tokens}}


async def handle_messages(request: web.Request) -> web.StreamResponse:
    record, body, raw = await open_record(request, key=request.headers.get("X-Emu-Key") or None,
                                          auth_present=_auth_present(request))
    with logged(record, logger):
        problem = refusal(request, record, _validate(body), 401,
                          "x-api-key header is required (emulated)")
        if problem is not None:
            return _error_response(record.status, record.n, None, problem)
        record.model, record.key = split_model_key(body["model"], record.key)
        step = take_step(request, record, body, raw)
        record.stream = body.get("stream") is True
        return await _respond(request, record, step, body)


def _validate(body: object) -> str | None:
    if not isinstance(body, dict):
        return "There was an issue with the format of your request: invalid JSON (emulated)"
    if not isinstance(body.get("model"), str):
        return "model: Field required"
    if not isinstance(body.get("messages"), list):
        return "messages: Field required"
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        return "max_tokens: Field required"
    return None


async def _respond(request: web.Request, record: RequestRecord, step: Step,
                   body: dict[str, Any]) -> web.StreamResponse:
    if step.fault is Fault.STATUS:
        record.status = step.status
        headers = {"Retry-After": step.retry_after} if step.retry_after is not None else None
        record.end(completed=True)
        return _error_response(step.status, record.n, step, extra=headers)
    message = _Message(record, step, body)
    if not record.stream:
        payload = await answer_whole(request, record, step, message.message, message.text,
                                     orjson.dumps(_stream_error(step)))
        return web.Response(status=200) if payload is None else _json_response(200, payload, record.n)
    return await answer_stream(request, record, step, message.plan(step), {
        "Content-Type": "text/event-stream; charset=utf-8",
        "Cache-Control": "no-cache",
        "request-id": f"req_emu_{record.n}",
        "x-request-id": f"req_emu_{record.n}",
    })
