"""OpenAI chat completions on the wire: ``POST /v1/chat/completions``.

Contract
--------
* Streaming (``"stream": true``): ``text/event-stream`` with one
  ``data: {json}\\n\\n`` event per chunk in OpenAI's format
  (``chat.completion.chunk``; ``choices[0].delta`` with ``role`` on the first
  chunk, then ``reasoning_content`` / ``content`` / ``refusal`` /
  ``tool_calls``), a finish chunk (empty delta + ``finish_reason``), a
  choiceless usage chunk when ``stream_options.include_usage`` is true (and
  ``"usage": null`` on every other chunk then, as OpenAI does), and
  ``data: [DONE]``.
* Chunk order, which ``after`` counts in: reasoning pieces, text pieces,
  refusal pieces, the tool-call header delta (index/id/type/function.name),
  the tool-argument pieces, the finish chunk, the usage chunk. Each part is
  split into ``chunks`` pieces (fewer if it is shorter). The role rides on
  the first chunk, so ``chunks=8`` of plain text is exactly 8 text chunks.
* Non-streaming: a ``chat.completion`` body. Faults there: ``stall`` and
  ``keepalive`` wait ``stall_s`` first; ``disconnect`` aborts before any
  byte; ``no_finish`` gives ``finish_reason: null``; ``malformed`` a 200 with
  an undecodable body; ``empty`` a 200 with an empty body; ``error_event`` a
  200 whose body is ``{"error": ...}``.
* ``status`` (either mode): that HTTP status with OpenAI's error body
  ``{"error": {"message", "type", "param", "code"}}`` and ``Retry-After``
  when scripted.
* A body that is not a JSON object with a string ``model`` and a list
  ``messages`` gets a 400 ``invalid_request_error`` (logged, consumes no
  step). With ``--require-auth`` a request without a bearer token gets 401.
* Every response carries ``x-request-id: req_emu_<n>``.
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

logger = logging.getLogger("streamfence.devtools.emulator.openai")

_DEFAULT_ERRORS: dict[int, tuple[str, str, str | None]] = {
    400: ("Invalid request (emulated).", "invalid_request_error", None),
    401: ("Incorrect API key provided (emulated).", "invalid_request_error", "invalid_api_key"),
    403: ("You are not allowed to use this model (emulated).", "invalid_request_error", None),
    404: ("The model does not exist (emulated).", "invalid_request_error", "model_not_found"),
    429: ("Rate limit reached for requests (emulated).", "requests", "rate_limit_exceeded"),
    500: (
        "The server had an error while processing your request (emulated).",
        "server_error",
        None,
    ),
    502: ("Bad gateway (emulated).", "server_error", None),
    503: (
        "The engine is currently overloaded, please try again later (emulated).",
        "server_error",
        None,
    ),
}
_STREAM_ERROR = "The server had an error while processing your request (emulated)."


def _error_body(status: int, step: Step | None, message: str | None = None) -> bytes:
    default = _DEFAULT_ERRORS.get(
        status,
        (
            f"Error {status} (emulated).",
            "server_error" if status >= 500 else "invalid_request_error",
            None,
        ),
    )
    msg = message or (step.message if step else None) or default[0]
    err = {
        "message": msg,
        "type": (step.error_type if step else None) or default[1],
        "param": None,
        "code": (step.error_code if step else None) or default[2],
    }
    return orjson.dumps({"error": err})


def _json_response(
    status: int, body: bytes, n: int, extra: dict[str, str] | None = None
) -> web.Response:
    headers = {"x-request-id": f"req_emu_{n}", **(extra or {})}
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


def _auth_present(request: web.Request) -> bool:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and bool(token.strip())


def _prompt_tokens(body: dict[str, Any]) -> int:
    chars = 0
    for message in body.get("messages") or ():
        if isinstance(message, dict):
            chars += len(str(message.get("content") or ""))
    return max(1, chars // 4)


class _Response:
    """The scripted content of one response, before it is framed."""

    def __init__(self, record: RequestRecord, step: Step, body: dict[str, Any]):
        n = record.n
        self.text = (
            step.text
            if step.text is not None
            else ("" if step.tool_call else default_text(n, record.key, step.chunks))
        )
        if step.reasoning is True:
            self.reasoning = default_reasoning(n, step.chunks)
        else:
            self.reasoning = step.reasoning or ""
        self.refusal = step.refusal or ""
        self.tool_call = step.tool_call
        self.tool_id = f"call_emu_{n}_0"
        default_finish = "tool_calls" if step.tool_call else "stop"
        self.finish_reason = step.finish_reason or default_finish
        self.pieces = {
            "reasoning_content": split_text(self.reasoning, step.chunks),
            "content": split_text(self.text, step.chunks),
            "refusal": split_text(self.refusal, step.chunks),
        }
        self.arg_pieces = (
            split_text(step.tool_call.arguments, step.chunks) if step.tool_call else []
        )
        completion = sum(len(p) for p in self.pieces.values()) + len(self.arg_pieces)
        prompt = _prompt_tokens(body)
        self.usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        self.id = f"chatcmpl-emu{n}"
        self.meta: dict[str, Any] = {
            "created": int(record.started),
            "model": record.model,
            "system_fingerprint": "fp_emu",
        }
        record.usage = self.usage
        record.text = self.text
        record.reasoning_text = self.reasoning
        record.refusal = self.refusal
        if step.tool_call:
            record.tool_call = {
                "id": self.tool_id,
                "name": step.tool_call.name,
                "arguments": step.tool_call.arguments,
            }

    def plan(self, step: Step, include_usage: bool) -> StreamPlan:
        head = {"id": self.id, "object": "chat.completion.chunk", **self.meta}
        usage_null = b',"usage":null' if include_usage else b""
        prefix = b"data: " + orjson.dumps(head)[:-1] + b',"choices":[{"index":0,"delta":'
        suffix = b',"logprobs":null,"finish_reason":null}]' + usage_null + b"}\n\n"
        deltas: list[tuple[dict[str, Any], str]] = []
        for field, pieces in self.pieces.items():
            for piece in pieces:
                deltas.append(({field: piece}, piece if field == "content" else ""))
        if self.tool_call:
            first = {
                "index": 0,
                "id": self.tool_id,
                "type": "function",
                "function": {"name": self.tool_call.name, "arguments": ""},
            }
            deltas.append(({"tool_calls": [first]}, ""))
            for piece in self.arg_pieces:
                deltas.append(
                    ({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}, "")
                )
        if not deltas:
            deltas.append(({"content": ""}, ""))
        deltas[0] = ({"role": "assistant", **deltas[0][0]}, deltas[0][1])
        body = [Chunk(prefix + orjson.dumps(d) + suffix, text) for d, text in deltas]
        finish = {
            **head,
            "choices": [
                {"index": 0, "delta": {}, "logprobs": None, "finish_reason": self.finish_reason}
            ],
        }
        if include_usage:
            finish["usage"] = None
        tail = [Chunk(b"data: " + orjson.dumps(finish) + b"\n\n")]
        if include_usage:
            usage = {**head, "choices": [], "usage": self.usage}
            tail.append(Chunk(b"data: " + orjson.dumps(usage) + b"\n\n"))
        return StreamPlan(
            body=body,
            tail=tail,
            done=b"data: [DONE]\n\n",
            keepalive=b": keep-alive\n\n",
            malformed=b"data: {not json\n\n",
            error_event=_stream_error(step),
            empty_frame=b"data: \n\n",
        )

    def completion(self, finish: bool) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": self.text or None,
            "refusal": self.refusal or None,
        }
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.tool_call:
            message["tool_calls"] = [
                {
                    "id": self.tool_id,
                    "type": "function",
                    "function": {
                        "name": self.tool_call.name,
                        "arguments": self.tool_call.arguments,
                    },
                }
            ]
        choice = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": self.finish_reason if finish else None,
        }
        return {
            "id": self.id,
            "object": "chat.completion",
            **self.meta,
            "choices": [choice],
            "usage": self.usage,
        }


def _stream_error(step: Step) -> bytes:
    err = {
        "message": step.message or _STREAM_ERROR,
        "type": step.error_type or "server_error",
        "param": None,
        "code": step.error_code,
    }
    return b"data: " + orjson.dumps({"error": err}) + b"\n\n"


async def handle_chat_completions(request: web.Request) -> web.StreamResponse:
    record, body, raw = await open_record(
        request, key=request.headers.get("X-Emu-Key") or None, auth_present=_auth_present(request)
    )
    with logged(record, logger):
        problem = refusal(
            request, record, _validate(body), 401, "You didn't provide an API key (emulated)."
        )
        if problem is not None:
            return _json_response(record.status, _error_body(record.status, None, problem), record.n)
        record.model, record.key = split_model_key(body["model"], record.key)
        step = take_step(request, record, body, raw)
        record.stream = body.get("stream") is True
        record.has_stream_options = "stream_options" in body
        record.stream_options = body.get("stream_options")
        return await _respond(request, record, step, body)


def _validate(body: object) -> str | None:
    if not isinstance(body, dict):
        return "We could not parse the JSON body of your request (emulated)."
    if not isinstance(body.get("model"), str):
        return "you must provide a model parameter"
    if not isinstance(body.get("messages"), list):
        return "Missing required parameter: 'messages'."
    return None


async def _respond(
    request: web.Request, record: RequestRecord, step: Step, body: dict[str, Any]
) -> web.StreamResponse:
    if step.fault is Fault.STATUS:
        record.status = step.status
        headers = {"Retry-After": step.retry_after} if step.retry_after is not None else None
        record.end(completed=True)
        return _json_response(step.status, _error_body(step.status, step), record.n, headers)
    content = _Response(record, step, body)
    if not record.stream:
        error = _stream_error(step)[len(b"data: ") : -2]
        payload = await answer_whole(request, record, step, content.completion, content.text, error)
        return web.Response(status=200) if payload is None else _json_response(200, payload, record.n)
    options = body.get("stream_options")
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    headers = {
        "Content-Type": "text/event-stream; charset=utf-8",
        "Cache-Control": "no-cache",
        "x-request-id": f"req_emu_{record.n}",
    }
    return await answer_stream(request, record, step, content.plan(step, include_usage), headers)
