"""Playing a scripted streaming response onto the socket, wire-agnostically.

Contract
--------
* A wire module (``openai_wire``; later Anthropic SSE, Bedrock event-stream)
  renders a response as a :class:`StreamPlan`: already-framed bytes for each
  data chunk, the terminator, and the framed bytes of the fault lines
  (keep-alive, malformed, in-stream error). :func:`play` applies the step's
  fault to that plan; it knows nothing about any provider's format.
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
import time
from collections.abc import Sequence
from dataclasses import dataclass

from aiohttp import web

from .script import Fault, Step
from .state import RequestRecord

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
