"""Bedrock Converse on the wire: ``POST /model/{modelId}/converse-stream`` and ``/converse``.

Contract
--------
* ``converse-stream``: a 200 with ``Content-Type: application/vnd.amazon.eventstream``
  whose chunked body is AWS binary event-stream messages (:mod:`streamfence.devtools.emulator.eventstream`),
  one per event, as Bedrock sends them and boto3 parses them:

    ``messageStart`` ``{"role": "assistant"}``
    reasoning block: ``contentBlockDelta`` ``{"reasoningContent": {"text"}}`` per piece,
        one ``{"reasoningContent": {"signature"}}`` delta, ``contentBlockStop``
    text block: ``contentBlockDelta`` ``{"text"}`` per piece, ``contentBlockStop``
    refusal: a second text block (Bedrock has no refusal channel; a guardrail's
        message is plain text with ``stopReason: guardrail_intervened``)
    tool block: ``contentBlockStart`` ``{"start": {"toolUse": {"toolUseId", "name"}}}``,
        ``contentBlockDelta`` ``{"toolUse": {"input": partial JSON}}`` per piece,
        ``contentBlockStop``
    ``messageStop`` ``{"stopReason"}``, ``metadata`` ``{"usage": {inputTokens,
        outputTokens, totalTokens}, "metrics": {"latencyMs"}}``

  Blocks are numbered (``contentBlockIndex``) 0, 1, … in that order, only the
  present ones. ``after`` counts every event from ``messageStart`` on, so
  ``chunks=8`` of plain text is 12 events (start, 8 deltas, block stop,
  messageStop, metadata). ``no_finish`` drops ``messageStop`` and
  ``metadata``; ``empty`` is a 200 with an empty body; ``malformed`` a frame
  with a wrong CRC; ``error_event`` an exception message (``:message-type
  exception``, ``:exception-type`` = the step's ``error_type``, default
  ``modelStreamErrorException``); ``keepalive`` frames are events of a type the
  service model does not know (``keepAlive``), which boto3 parses and drops,
  so they never reach an adapter; ``stall`` holds the connection silent, then
  resumes on it.
* ``converse`` (non-streaming): ``{"output": {"message": {"role", "content":
  [blocks]}}, "stopReason", "usage", "metrics"}`` with blocks ``{"reasoningContent":
  {"reasoningText": {"text", "signature"}}}``, ``{"text"}``, ``{"toolUse":
  {"toolUseId", "name", "input": object}}`` (the raw string when the scripted
  arguments are not JSON). Faults: ``stall``/``keepalive`` wait first,
  ``disconnect`` aborts before any byte, ``no_finish`` omits ``stopReason``,
  ``malformed`` / ``empty`` a 200 with an undecodable / empty body,
  ``error_event`` the HTTP error of that exception type, ``access_denied`` is ok.
* Errors (``status`` in either mode; ``access_denied`` on converse-stream):
  the HTTP status, ``x-amzn-ErrorType: <Type>:http://internal.amazon.com/coral/
  com.amazon.bedrock/`` and a ``{"message"}`` body, as Bedrock answers; the
  type is the step's ``error_type`` or the status's usual one (403
  AccessDeniedException, 429 ThrottlingException, 503 ServiceUnavailableException…).
* ``finish_reason`` in a step may be a Bedrock stopReason or an OpenAI name
  (``stop`` -> ``end_turn``, ``length`` -> ``max_tokens``, ``tool_calls`` ->
  ``tool_use``, ``content_filter`` -> ``content_filtered``).
* The script key is the model id's ``#KEY`` suffix (boto3 sends it
  percent-encoded in the path; aiohttp decodes it) or the ``X-Emu-Key`` header.
  ``auth_present`` means a SigV4 ``Authorization`` header; with
  ``--require-auth`` a request without one gets 403 UnrecognizedClientException.
* The request log: ``sent_text`` holds the text (and refusal) pieces written,
  ``chunks_sent`` every event written (not keep-alive, malformed or exception
  frames). Every response carries ``x-amzn-RequestId: emu-<n>``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson
from aiohttp import web

from . import eventstream
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

logger = logging.getLogger("streamfence.devtools.emulator.bedrock")

EVENTSTREAM = "application/vnd.amazon.eventstream"
_ERROR_NS = ":http://internal.amazon.com/coral/com.amazon.bedrock/"

_STATUS_TYPES: dict[int, tuple[str, str]] = {
    400: ("ValidationException", "Malformed input request (emulated)."),
    403: ("AccessDeniedException", "You don't have access to the model with the specified model ID (emulated)."),
    404: ("ResourceNotFoundException", "The model does not exist (emulated)."),
    408: ("ModelTimeoutException", "The model took too long to respond (emulated)."),
    424: ("ModelErrorException", "The model returned an error (emulated)."),
    429: ("ThrottlingException", "Too many requests, please wait before trying again (emulated)."),
    500: ("InternalServerException", "The server encountered an internal error (emulated)."),
    503: ("ServiceUnavailableException", "Bedrock is unable to process your request (emulated)."),
}
# In-stream exception member -> (HTTP status, error type) of the same failure on ``converse``.
_STREAM_EXCEPTIONS: dict[str, tuple[int, str]] = {
    "modelStreamErrorException": (424, "ModelErrorException"),
    "throttlingException": (429, "ThrottlingException"),
    "serviceUnavailableException": (503, "ServiceUnavailableException"),
    "internalServerException": (500, "InternalServerException"),
    "validationException": (400, "ValidationException"),
}
_STOP_ALIASES = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                 "content_filter": "content_filtered"}
_DEFAULT_STREAM_EXCEPTION = "modelStreamErrorException"
_STREAM_ERROR = "The model stream encountered an error (emulated)."


def _denied_message(model: str) -> str:
    return ("User: arn:aws:iam::000000000000:user/emu is not authorized to perform: "
            "bedrock:InvokeModelWithResponseStream on resource: arn:aws:bedrock:us-east-1::"
            f"foundation-model/{model} because no identity-based policy allows the "
            "bedrock:InvokeModelWithResponseStream action (emulated)")


def _error_response(status: int, n: int, error_type: str | None = None,
                    message: str | None = None, retry_after: str | None = None) -> web.Response:
    default_type, default_message = _STATUS_TYPES.get(
        status, ("InternalServerException" if status >= 500 else "ValidationException",
                 f"Error {status} (emulated)."))
    etype = error_type or default_type
    headers = {"x-amzn-RequestId": f"emu-{n}", "x-amzn-ErrorType": etype + _ERROR_NS}
    if retry_after is not None:
        headers["Retry-After"] = retry_after
    body = orjson.dumps({"message": message or default_message})
    return web.Response(status=status, body=body, content_type="application/json",
                        headers=headers)


def _prompt_tokens(body: dict[str, Any]) -> int:
    chars = 0
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        for block in content if isinstance(content, list) else ():
            if isinstance(block, dict) and isinstance(block.get("text"), str):
                chars += len(block["text"])
    return max(1, chars // 4)


def _delta(index: int, delta: dict[str, Any]) -> bytes:
    payload = orjson.dumps({"contentBlockIndex": index, "delta": delta})
    return eventstream.event("contentBlockDelta", payload)


def _stop(index: int) -> Chunk:
    return Chunk(eventstream.event("contentBlockStop", orjson.dumps({"contentBlockIndex": index})))


class _Converse:
    """The scripted content of one response, before it is framed."""

    def __init__(self, record: RequestRecord, step: Step, body: dict[str, Any]):
        n = record.n
        self.text = (step.text if step.text is not None
                     else ("" if step.tool_call else default_text(n, record.key, step.chunks)))
        self.reasoning = (default_reasoning(n, step.chunks) if step.reasoning is True
                          else step.reasoning or "")
        self.refusal = step.refusal or ""
        self.tool_call = step.tool_call
        self.tool_id = f"tooluse_emu{n}_0"
        self.signature = f"emu-signature-{n}"
        default = ("tool_use" if step.tool_call
                   else "guardrail_intervened" if self.refusal else "end_turn")
        finish = step.finish_reason or default
        self.stop_reason = _STOP_ALIASES.get(finish, finish)
        chunks = step.chunks
        self.pieces = {"reasoning": split_text(self.reasoning, chunks),
                       "text": split_text(self.text, chunks),
                       "refusal": split_text(self.refusal, chunks),
                       "tool": split_text(step.tool_call.arguments, chunks) if step.tool_call else []}
        output = sum(len(p) for p in self.pieces.values())
        prompt = _prompt_tokens(body)
        self.usage = {"inputTokens": prompt, "outputTokens": output,
                      "totalTokens": prompt + output}
        self.started = record.started
        record.usage = self.usage
        record.text = self.text
        record.reasoning_text = self.reasoning
        record.refusal = self.refusal
        if step.tool_call:
            record.tool_call = {"id": self.tool_id, "name": step.tool_call.name,
                                "arguments": step.tool_call.arguments}

    def _metrics(self) -> dict[str, int]:
        return {"latencyMs": max(1, int((time.time() - self.started) * 1000))}

    def plan(self, step: Step) -> StreamPlan:
        body = [Chunk(eventstream.event("messageStart", b'{"role":"assistant"}'))]
        index = 0
        if self.pieces["reasoning"]:
            for piece in self.pieces["reasoning"]:
                body.append(Chunk(_delta(index, {"reasoningContent": {"text": piece}})))
            body.append(Chunk(_delta(index, {"reasoningContent": {"signature": self.signature}})))
            body.append(_stop(index))
            index += 1
        for part in ("text", "refusal"):
            if self.pieces[part]:
                body.extend(Chunk(_delta(index, {"text": p}), p) for p in self.pieces[part])
                body.append(_stop(index))
                index += 1
        if self.tool_call:
            start = {"contentBlockIndex": index, "start": {"toolUse": {
                "toolUseId": self.tool_id, "name": self.tool_call.name}}}
            body.append(Chunk(eventstream.event("contentBlockStart", orjson.dumps(start))))
            body.extend(Chunk(_delta(index, {"toolUse": {"input": p}}))
                        for p in self.pieces["tool"])
            body.append(_stop(index))
        stop = orjson.dumps({"stopReason": self.stop_reason})
        metadata = orjson.dumps({"usage": self.usage, "metrics": self._metrics()})
        tail = [Chunk(eventstream.event("messageStop", stop)),
                Chunk(eventstream.event("metadata", metadata))]
        exc_type = step.error_type or _DEFAULT_STREAM_EXCEPTION
        error = orjson.dumps({"message": step.message or _STREAM_ERROR})
        return StreamPlan(
            body=body, tail=tail, done=b"",
            keepalive=eventstream.event("keepAlive", b"{}"),
            malformed=eventstream.corrupt(eventstream.event("contentBlockDelta", b"{}")),
            error_event=eventstream.exception(exc_type, error),
        )

    def message(self, finish: bool) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if self.reasoning:
            content.append({"reasoningContent": {"reasoningText": {
                "text": self.reasoning, "signature": self.signature}}})
        content.extend({"text": t} for t in (self.text, self.refusal) if t)
        if self.tool_call:
            try:
                tool_input: Any = orjson.loads(self.tool_call.arguments)
            except orjson.JSONDecodeError:
                tool_input = self.tool_call.arguments
            content.append({"toolUse": {"toolUseId": self.tool_id, "name": self.tool_call.name,
                                        "input": tool_input}})
        out: dict[str, Any] = {"output": {"message": {"role": "assistant", "content": content}}}
        if finish:
            out["stopReason"] = self.stop_reason
        out["usage"] = self.usage
        out["metrics"] = self._metrics()
        return out


async def handle_converse_stream(request: web.Request) -> web.StreamResponse:
    return await _handle(request, stream=True)


async def handle_converse(request: web.Request) -> web.StreamResponse:
    return await _handle(request, stream=False)


def _validate(body: object) -> str | None:
    if not isinstance(body, dict):
        return "Malformed input request: the body is not a JSON object (emulated)."
    if not isinstance(body.get("messages"), list):
        return "Malformed input request: #: required key [messages] not found (emulated)."
    return None


async def _handle(request: web.Request, *, stream: bool) -> web.StreamResponse:
    model, key = split_model_key(request.match_info["modelId"],
                                 request.headers.get("X-Emu-Key") or None)
    auth = request.headers.get("Authorization", "").startswith("AWS4-HMAC-SHA256 ")
    record, body, raw = await open_record(request, key=key, auth_present=auth, model=model,
                                          stream=stream)
    with logged(record, logger):
        problem = refusal(request, record, _validate(body), 403,
                          "The security token included in the request is invalid.")
        if problem is not None:
            etype = "UnrecognizedClientException" if record.status == 403 else None
            return _error_response(record.status, record.n, etype, problem)
        step = take_step(request, record, body, raw)
        if stream:
            return await _respond_stream(request, record, step, body)
        return await _respond_whole(request, record, step, body)


def _status_fault(record: RequestRecord, step: Step) -> web.Response | None:
    if step.fault is Fault.STATUS:
        status, etype, message = step.status, step.error_type, step.message
    elif step.fault is Fault.ACCESS_DENIED and record.stream:
        status, etype, message = 403, "AccessDeniedException", _denied_message(record.model)
    elif step.fault is Fault.ERROR_EVENT and not record.stream:
        exc_type = step.error_type or _DEFAULT_STREAM_EXCEPTION
        status, etype = _STREAM_EXCEPTIONS.get(exc_type, (500, "InternalServerException"))
        message = step.message or _STREAM_ERROR
    else:
        return None
    record.status = status
    record.end(completed=True)
    return _error_response(status, record.n, etype, message, step.retry_after)


async def _respond_stream(request: web.Request, record: RequestRecord, step: Step,
                          body: dict[str, Any]) -> web.StreamResponse:
    error = _status_fault(record, step)
    if error is not None:
        return error
    plan = _Converse(record, step, body).plan(step)
    return await answer_stream(request, record, step, plan, {
        "Content-Type": EVENTSTREAM, "x-amzn-RequestId": f"emu-{record.n}"})


async def _respond_whole(request: web.Request, record: RequestRecord, step: Step,
                         body: dict[str, Any]) -> web.StreamResponse:
    error = _status_fault(record, step)
    if error is not None:
        return error
    content = _Converse(record, step, body)
    # error_event was answered above, as the HTTP error of that exception.
    payload = await answer_whole(request, record, step, content.message,
                                 content.text + content.refusal)
    if payload is None:
        return web.Response(status=200)
    return web.Response(status=200, body=payload, content_type="application/json",
                        headers={"x-amzn-RequestId": f"emu-{record.n}"})
