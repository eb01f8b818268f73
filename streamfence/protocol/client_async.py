"""The asyncio flavour of the client (zmq.asyncio): `AsyncClient`.

Same methods, arguments and replies as `streamfence.protocol.client.Client` (see that
module for the protocol each method speaks); the requests are coroutines,
`events()` and `stream_text()` are async iterators, `close()` stays a plain
method. Tasks of one event loop may share a client: whichever task is waiting
receives for everyone (one at a time, guarded by a condition), routes each
frame through the shared Router, and wakes the others, so no background task
exists that could outlive the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Mapping, Sequence
from time import monotonic
from types import TracebackType
from typing import Any

import zmq
import zmq.asyncio

from streamfence.protocol.client_base import (
    DEFAULT_ENDPOINT,
    AsyncTextStream,
    ClientBase,
    EventWatch,
    Options,
    call_msg,
    expect_reply,
    new_ref,
    raw_ref,
    status_msg,
    submit_msg,
)
from streamfence.protocol.client_router import BAD_REPLY, ClientError
from streamfence.protocol.codec import DEFAULT_MAX_FRAME, encode
from streamfence.protocol.messages import Op


class AsyncClient(ClientBase):
    """asyncio client. Use `async with` (or `with`) or call close()."""

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, timeout_s: float = 10.0, *,
                 context: zmq.asyncio.Context | None = None,
                 max_frame: int = DEFAULT_MAX_FRAME) -> None:
        super().__init__(endpoint, timeout_s, max_frame)
        ctx = context if context is not None else zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.connect(endpoint)
        except BaseException:
            self._sock.close(linger=0)
            raise
        self._cond = asyncio.Condition()
        self._pumping = False

    def close(self) -> None:
        """Close the socket (linger 0: unsent requests are dropped). Idempotent."""
        if not self._closed:
            self._closed = True
            self._sock.close(linger=0)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.close()

    def __enter__(self) -> AsyncClient:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # ---- transport --------------------------------------------------------

    async def _send(self, frames: Sequence[bytes], what: str) -> None:
        self._check_open()
        try:
            await asyncio.wait_for(self._sock.send_multipart(frames), self.timeout_s)
        except (TimeoutError, zmq.Again):
            raise TimeoutError(f"could not send {what} to {self.endpoint} within "
                               f"{self.timeout_s:g} s") from None

    async def _pump(self, deadline: float) -> None:
        """Wait for frames until `deadline` and route them, or, if another task
        is receiving, wait until it has routed something."""
        self._check_open()
        async with self._cond:
            if self._pumping:
                remaining = deadline - monotonic()
                if remaining > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._cond.wait(), remaining)
                return
            self._pumping = True
        try:
            wait_ms = max(0, math.ceil((deadline - monotonic()) * 1000))
            if await self._sock.poll(wait_ms):
                while True:
                    try:
                        frames = await self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if self._router.route(frames):
                        break
        finally:
            async with self._cond:
                self._pumping = False
                self._cond.notify_all()

    async def _exchange(self, msg: dict[str, Any], what: str, timeout_s: float) -> dict[str, Any]:
        ref: str = msg["ref"]
        self._router.expect(ref)
        try:
            await self._send([encode(msg)], what)
            deadline = monotonic() + timeout_s
            while (reply := self._router.take_reply(ref)) is None:
                if monotonic() >= deadline:
                    raise self._no_reply(what, ref, timeout_s)
                await self._pump(deadline)
            return reply
        finally:
            self._router.forget(ref)

    # ---- requests (documented on streamfence.protocol.client.Client) -------------------

    async def request(self, msg: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        timeout = self._timeout(timeout_s)
        if raw_ref(msg) is None:
            return await self.request_raw(encode(msg), timeout)
        return await self._exchange(msg, f"{msg.get('op')!r} request", timeout)

    async def request_raw(self, frames: bytes | Sequence[bytes],
                          timeout_s: float | None = None) -> dict[str, Any]:
        timeout = self._timeout(timeout_s)
        parts = [frames] if isinstance(frames, bytes) else list(frames)
        self._router.expect_raw()
        try:
            await self._send(parts, "a raw message")
            deadline = monotonic() + timeout
            while (reply := self._router.take_unattributed()) is None:
                if monotonic() >= deadline:
                    raise self._no_reply("a raw message", None, timeout)
                await self._pump(deadline)
            return reply
        except BaseException:
            self._router.forget_raw()
            raise

    async def submit(self, provider: str, request: Mapping[str, Any], *,
                     session_id: str | None = None, idempotency_key: str | None = None,
                     options: Options | None = None, subscribe: bool = True) -> str:
        ref = new_ref()
        msg = submit_msg(ref, provider, request, session_id=session_id,
                         idempotency_key=idempotency_key, options=options, subscribe=subscribe)
        reply = expect_reply(await self._exchange(msg, "submit", self.timeout_s),
                             (Op.ACCEPTED,), "submit")
        call_id = reply.get("call_id")
        if not isinstance(call_id, str):
            raise ClientError(BAD_REPLY, f"accepted without a call_id: {reply!r}", reply)
        if subscribe:
            self._router.reading(call_id, 0)
        return call_id

    async def subscribe(self, call_id: str, from_seq: int = 0) -> None:
        ref = new_ref()
        msg = call_msg(Op.SUBSCRIBE, ref, call_id, from_seq=from_seq)
        self._router.subscribing(ref, call_id, from_seq)
        await self._send([encode(msg)], f"subscribe of call {call_id}")

    async def events(self, call_id: str, *,
                     timeout_s: float | None = None) -> AsyncIterator[dict[str, Any]]:
        now = monotonic()
        watch = EventWatch(call_id, timeout_s, self.timeout_s, now, now)
        while True:
            event = self._router.next_event(call_id)
            if event is not None:
                watch.on_event(monotonic())
                yield event
                if event["op"] == Op.DONE:
                    return
                continue
            if self._router.is_finished(call_id):
                return
            gap_from = self._router.gap(call_id)
            if gap_from is not None:
                await self.subscribe(call_id, gap_from)
            if watch.due(monotonic(), self.last_seq(call_id)):
                await self.subscribe(call_id, self.last_seq(call_id))
                try:
                    reply = await self.result(call_id)
                except TimeoutError as exc:
                    raise watch.probe_failed(exc, self.last_seq(call_id)) from None
                done = watch.probed(monotonic(), reply, self.last_seq(call_id))
                if done is not None:
                    self._router.deliver(done)
                continue
            await self._pump(watch.deadline())

    async def result(self, call_id: str, wait_s: float = 0.0) -> dict[str, Any] | None:
        what = f"result of call {call_id}"
        reply = expect_reply(
            await self._exchange(call_msg(Op.RESULT, new_ref(), call_id, wait_s=wait_s), what,
                                 wait_s + self.timeout_s), (Op.DONE, Op.PENDING), what)
        return reply if reply["op"] == Op.DONE else None

    async def cancel(self, call_id: str) -> dict[str, Any]:
        what = f"cancel of call {call_id}"
        return expect_reply(
            await self._exchange(call_msg(Op.CANCEL, new_ref(), call_id), what, self.timeout_s),
            (Op.CANCELLING, Op.DONE), what)

    async def status(self) -> dict[str, Any]:
        return expect_reply(await self._exchange(status_msg(new_ref()), "status", self.timeout_s),
                            (Op.STATUS_REPLY,), "status")

    def stream_text(self, provider: str, request: Mapping[str, Any], *, markers: bool = False,
                    timeout_s: float | None = None, **submit_kw: Any) -> AsyncTextStream:
        return AsyncTextStream(
            lambda: self.submit(provider, request, subscribe=True, **submit_kw),
            lambda cid: self.events(cid, timeout_s=timeout_s), markers)

    async def run(self, provider: str, request: Mapping[str, Any], *,
                  timeout_s: float | None = None, **submit_kw: Any) -> dict[str, Any]:
        call_id = await self.submit(provider, request, subscribe=True, **submit_kw)
        async for event in self.events(call_id, timeout_s=timeout_s):
            if event["op"] == Op.DONE:
                return event
        raise ClientError(BAD_REPLY, f"the events of call {call_id} ended without a done")
