"""Serving one scripted response, wire-agnostically: its record, its stream, its faults.

Contract
--------
* A wire module (``openai_wire``, ``anthropic_wire``, ``bedrock_wire``) owns
  its formats; the exchange around them is the same for every wire and lives
  here. :func:`open_record` reads the body (``None`` when it is not JSON) and
  logs the request's :class:`RequestRecord`; inside ``with logged(record,
  logger)`` the handler answers, and on the way out a record nobody ended is
  ``aborted`` and the request's log line is written. :func:`refusal` turns
  away a body that fails validation (400) or, with ``--require-auth``, a
  request without credentials (the wire's status; the wire words the error
  body); else :func:`take_step` consumes the record key's next step.
* A wire renders a streaming response as a :class:`StreamPlan`:
  already-framed bytes for each data chunk, the terminator, and the framed
  bytes of the fault lines (keep-alive, malformed, in-stream error).
  :func:`answer_stream` sends the headers and :func:`play` applies the step's
  fault to that plan; neither knows anything about any provider's format.
* :func:`answer_whole` applies the step's fault to a non-streaming answer:
  ``stall`` and ``keepalive`` wait ``stall_s`` first; ``disconnect`` aborts
  before any byte; ``no_finish`` asks the wire for a message without its stop;
  ``malformed`` / ``empty`` give an undecodable / empty body; ``error_event``
  the wire's error body, when it has one.
* :class:`BodyWriter` is the only thing that writes a streaming body. It
  keeps the request's record true as it writes: ``chunks_sent``,
  ``sent_text``, ``keepalives_sent``, ``last_write``, and ``completed`` /
  ``aborted`` at the end.
* Chunks with no delay are written in batches of up to ``BATCH_BYTES`` (one
  ``write`` per batch, one event-loop yield per batch), so one process
  streams hundreds of thousands of chunks per second. With a delay, each
  chunk is its own write.
* A client that goes away is noticed before each write and, during a stall
  or keep-alive period, within ``WATCH_INTERVAL_S``; the record is then
  ``aborted`` and nothing more is written.
* ``disconnect`` lets the kernel flush what was written, then aborts the
  TCP connection (no terminator, no end of the chunked body).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from .script import Fault, Step
from .state import STATE_KEY, RequestRecord, summarize_request

BATCH_BYTES = 64 * 1024
WATCH_INTERVAL_S = 0.05
_FLUSH_WAIT_S = 2.0


@dataclass(frozen=True, slots=True)
class Chunk:
    data: bytes  # one framed event
    text: str = ""  # the visible response text it carries (for ``sent_text``)


@dataclass(frozen=True, slots=True)
class StreamPlan:
    body: Sequence[Chunk]  # reasoning / text / refusal / tool-call chunks
    tail: Sequence[Chunk]  # finish (and usage) chunks; ``no_finish`` drops them
    done: bytes  # terminator after the last chunk (b"" if the wire has none)
    keepalive: bytes  # one keep-alive frame (not a chunk)
    malformed: bytes  # an undecodable frame
    error_event: bytes  # an in-stream provider error frame
    empty_frame: bytes = b""  # an empty data frame (SSE `data:` with nothing); b"": keepalive


class ClientGone(Exception):
    """The client closed the connection (or the fault aborted it)."""


class BodyWriter:
    """Writes one streaming response body and keeps its record current."""

    def __init__(self, request: web.Request, response: web.StreamResponse, record: RequestRecord):
        self._request = request
        self._response = response
        self._record = record

    def _gone(self) -> bool:
        transport = self._request.transport
        return transport is None or transport.is_closing()

    async def _write(self, data: bytes) -> None:
        if self._gone():
            raise ClientGone
        try:
            await self._response.write(data)
        except (ConnectionError, RuntimeError) as err:
            # aiohttp raises ClientConnectionResetError (a ConnectionResetError)
            # or RuntimeError on a closing transport, depending on timing.
            raise ClientGone from err
        self._record.last_write = time.time()

    async def chunks(self, chunks: Sequence[Chunk], delay_s: float) -> None:
        record = self._record
        if delay_s > 0:
            for chunk in chunks:
                if record.chunks_sent:
                    await self.pause(delay_s)
                await self._write(chunk.data)
                record.chunks_sent += 1
                if chunk.text:
                    record.sent_parts.append(chunk.text)
            return
        i, total = 0, len(chunks)
        while i < total:
            batch: list[bytes] = []
            texts: list[str] = []
            size = 0
            while i < total and size < BATCH_BYTES:
                chunk = chunks[i]
                batch.append(chunk.data)
                size += len(chunk.data)
                if chunk.text:
                    texts.append(chunk.text)
                i += 1
            await self._write(b"".join(batch))
            record.chunks_sent += len(batch)
            record.sent_parts.extend(texts)
            if i < total:
                await asyncio.sleep(0)  # let other requests (and /_emu/log) run

    async def raw(self, data: bytes) -> None:
        """Write bytes that are not a data chunk (terminator, fault lines)."""
        if data:
            await self._write(data)

    async def pause(self, seconds: float) -> None:
        """Sleep, watching for the client to go away."""
        if not await sleep_watching(self._request, seconds):
            raise ClientGone

    async def keepalives(self, frame: bytes, seconds: float, every_s: float) -> None:
        """Send ``frame`` now and every ``every_s`` until ``seconds`` have passed."""
        start = time.monotonic()
        deadline = start + seconds
        beat = 0
        while True:
            await self._write(frame)
            self._record.keepalives_sent += 1
            beat += 1
            next_at = min(start + beat * every_s, deadline)
            await self.pause(max(0.0, next_at - time.monotonic()))
            if next_at >= deadline:
                return

    async def finish(self) -> None:
        """End the body cleanly (the terminating chunk of a chunked body)."""
        if self._gone():
            raise ClientGone
        try:
            await self._response.write_eof()
        except (ConnectionError, RuntimeError) as err:
            raise ClientGone from err

    async def abort(self) -> None:
        """Let written bytes reach the kernel, then abort the connection."""
        transport = self._request.transport
        if transport is None:
            return
        deadline = time.monotonic() + _FLUSH_WAIT_S
        while transport.get_write_buffer_size() and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        transport.abort()


async def play(writer: BodyWriter, plan: StreamPlan, step: Step, record: RequestRecord) -> None:
    """Write ``plan`` with ``step``'s fault applied; ends ``record``."""
    fault = step.fault
    chunks = [*plan.body, *plan.tail]
    cut = min(step.after, len(chunks))
    delay = step.chunk_delay_s
    try:
        if fault is Fault.EMPTY:
            await writer.raw(plan.done)
        elif fault is Fault.KEEPALIVE_ONLY:
            await writer.keepalives(plan.empty_frame or plan.keepalive, step.stall_s,
                                    step.keepalive_every_s)
            await writer.raw(plan.done)
        elif fault is Fault.NO_FINISH:
            await writer.chunks(plan.body, delay)
        elif fault in (Fault.OK, Fault.STALL, Fault.KEEPALIVE, Fault.STATUS):
            # STATUS never reaches here (it is answered before the stream);
            # treat it as OK for robustness.
            await writer.chunks(chunks[:cut], delay)
            if fault is Fault.STALL:
                await writer.pause(step.stall_s)
            elif fault is Fault.KEEPALIVE:
                await writer.keepalives(plan.keepalive, step.stall_s, step.keepalive_every_s)
            await writer.chunks(chunks[cut:], delay)
            await writer.raw(plan.done)
        else:
            await writer.chunks(chunks[:cut], delay)
            if fault is Fault.DISCONNECT:
                await writer.abort()
                record.end(aborted=True)
                return
            await writer.raw(plan.malformed if fault is Fault.MALFORMED else plan.error_event)
        await writer.finish()
    except ClientGone:
        record.end(aborted=True)
        return
    except asyncio.CancelledError:
        record.end(aborted=True)
        raise
    record.end(completed=fault in (Fault.OK, Fault.STALL, Fault.KEEPALIVE, Fault.EMPTY,
                                   Fault.KEEPALIVE_ONLY))


async def sleep_watching(request: web.Request, seconds: float) -> bool:
    """Sleep up to ``seconds``; False if the client went away meanwhile."""
    deadline = time.monotonic() + seconds
    while True:
        transport = request.transport
        if transport is None or transport.is_closing():
            return False
        left = deadline - time.monotonic()
        if left <= 0:
            return True
        await asyncio.sleep(min(left, WATCH_INTERVAL_S))


async def open_record(request: web.Request, *, key: str | None, auth_present: bool,
                      model: str = "", stream: bool = False) -> tuple[RequestRecord, Any, bytes]:
    """Read the request's body and log its new record: (record, JSON body or None, raw body)."""
    raw = await request.read()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = None
    log = request.app[STATE_KEY].log
    peer = request.transport.get_extra_info("peername") if request.transport else None
    record = RequestRecord(n=log.next_number(), key=key, path=request.path,
                           peer=f"{peer[0]}:{peer[1]}" if peer else "", model=model,
                           stream=stream, step=Step(), auth_present=auth_present)
    log.add(record)
    return record, body, raw


@contextlib.contextmanager
def logged(record: RequestRecord, logger: logging.Logger) -> Iterator[None]:
    """End ``record`` as aborted unless the answer ended it; then log its line."""
    try:
        yield
    finally:
        if record.ended is None:
            record.end(aborted=True)
        logger.info("request n=%d key=%s model=%s stream=%s fault=%s status=%d chunks_sent=%d "
                    "completed=%s aborted=%s", record.n, record.key, record.model, record.stream,
                    record.fault, record.status, record.chunks_sent, record.completed,
                    record.aborted)


def refusal(request: web.Request, record: RequestRecord, problem: str | None,
            auth_status: int, auth_problem: str) -> str | None:
    """The message when the body has a ``problem`` (400) or auth is required and absent
    (``auth_status``): the record then holds the status and is ended. None: go on."""
    if problem is not None:
        record.status = 400
    elif request.app[STATE_KEY].require_auth and not record.auth_present:
        record.status, problem = auth_status, auth_problem
    else:
        return None
    record.end(completed=True)
    return problem


def take_step(request: web.Request, record: RequestRecord, body: dict[str, Any],
              raw: bytes) -> Step:
    """The next step of the record's script key; the record notes it and the body."""
    record.step = step = request.app[STATE_KEY].scripts.take(record.key)
    record.request = summarize_request(body, len(raw))
    return step


async def answer_stream(request: web.Request, record: RequestRecord, step: Step,
                        plan: StreamPlan, headers: Mapping[str, str]) -> web.StreamResponse:
    """A 200 with ``headers``, then ``plan`` played with ``step``'s fault."""
    response = web.StreamResponse(status=200, headers=headers)
    try:
        await response.prepare(request)
    except (ConnectionError, RuntimeError):
        record.end(aborted=True)
        return response
    await play(BodyWriter(request, response, record), plan, step, record)
    return response


async def answer_whole(request: web.Request, record: RequestRecord, step: Step,
                       message: Callable[[bool], dict[str, Any]], text: str,
                       error: bytes | None = None) -> bytes | None:
    """The body of a non-streaming 200 with ``step``'s fault applied (see the module
    docstring); None when the client or the fault ended the exchange first.

    ``message(finish)`` renders the whole answer, ``text`` is what it delivers (for
    ``sent_text``), ``error`` the wire's body for ``error_event``.
    """
    fault = step.fault
    if fault in (Fault.STALL, Fault.KEEPALIVE) and not await sleep_watching(request, step.stall_s):
        record.end(aborted=True)
        return None
    if fault is Fault.DISCONNECT:
        if request.transport is not None:
            request.transport.abort()
        record.end(aborted=True)
        return None
    if fault is Fault.MALFORMED:
        payload = b"{not json"
    elif fault is Fault.EMPTY:
        payload = b""
    elif fault is Fault.ERROR_EVENT and error is not None:
        payload = error
    else:
        payload = orjson.dumps(message(fault is not Fault.NO_FINISH))
        record.sent_parts.append(text)
    record.end(completed=True)
    return payload
