"""The asyncio flavour of the client (zmq.asyncio): `AsyncClient`.

Same methods, arguments and replies as `streamfence.protocol.client.Client`
(see that module for the protocol each method speaks): both run the flows of
`client_core.ClientCore`, this one on a zmq.asyncio socket. The requests are
coroutines, `events()` and `stream_text()` are async iterators, `close()`
stays a plain method. Tasks of one event loop may share a client: whichever
task is waiting receives for everyone (one at a time, guarded by a
condition), routes each frame through the shared Router, and wakes the
others, so no background task exists that could outlive the client.

Cancel on abandon (client_core's docstring): the cancel of an abandoned call
is sent at once, without an await, on a synchronous shadow of the request
socket (a task may close a stream while another one is waiting in a poll),
except in the middle of a send or off the client's thread (a finalizer run
by another thread's garbage collection): then when the current operation
ends. `AsyncTextStream.close()` is a plain method, `aclose()` its awaitable
twin (`contextlib.aclosing`), and `async with` closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from time import monotonic
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, TypeVar

import zmq
import zmq.asyncio

from streamfence.protocol.client_base import DEFAULT_ENDPOINT
from streamfence.protocol.client_core import (
    ClientBase,
    ClientCore,
    Flow,
    Send,
    TextFlow,
    Wait,
    shown_as,
)
from streamfence.protocol.client_sockets import close_sockets
from streamfence.protocol.codec import DEFAULT_MAX_FRAME
from streamfence.protocol.credentials import Credentials, resolve

P = ParamSpec("P")
T = TypeVar("T")


def _awaitable(flow: Callable[Concatenate[ClientCore, P], Flow[T]]
               ) -> Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, T]]:
    """A ClientCore operation as an AsyncClient coroutine method (same arguments, docstring)."""
    @shown_as(flow)
    async def method(self: AsyncClient, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self._call(flow(self._core, *args, **kwargs))
    return method


class AsyncClient(ClientBase):
    """asyncio client. Use `async with` (or `with`) or call close()."""

    def __init__(self, endpoint: str | None = None, timeout_s: float = 10.0, *,
                 credentials: Credentials | str | os.PathLike[str] | None = None,
                 context: zmq.asyncio.Context | None = None,
                 max_frame: int = DEFAULT_MAX_FRAME) -> None:
        endpoint, creds = resolve(endpoint, credentials, DEFAULT_ENDPOINT)
        super().__init__(endpoint, timeout_s, max_frame)
        ctx = context if context is not None else zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket = ctx.socket(zmq.DEALER)
        self._events: zmq.asyncio.Socket = ctx.socket(zmq.DEALER)
        self._events.setsockopt(zmq.ROUTING_ID, self._core.listener.encode())
        self._poller = zmq.asyncio.Poller()
        try:
            for sock, where in ((self._sock, endpoint), (self._events, self._core.events_endpoint)):
                sock.setsockopt(zmq.LINGER, 0)
                if creds is not None:
                    creds.apply(sock)
                sock.connect(where)
                self._poller.register(sock, zmq.POLLIN)
        except BaseException:
            self._sock.close(linger=0)
            self._events.close(linger=0)
            raise
        # Each handshake of the events connection (a reconnect: resubscribe).
        self._monitor: zmq.asyncio.Socket = self._events.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._cond = asyncio.Condition()
        self._pumping = False
        # The cancels of abandoned calls go out without an await (_send_cancels).
        self._sync_sock: zmq.Socket[bytes] = zmq.Socket.shadow(self._sock.underlying)
        self._thread = threading.get_ident()  # set again by each operation (_call)
        self._sending = False  # inside a send or a flush: a cancel waits for its end

    def close(self) -> None:
        """As Client.close: cancel the unfinished stream_text / run calls (not
        detached), then close the sockets. Idempotent."""
        if not self._closed:
            self._core.leave_all()
            self._send_cancels()
            self._closed = True
            linger_ms = self._core.closing()
            if linger_ms:
                self._sock.close(linger=linger_ms)  # close_sockets then finds it closed
            close_sockets(self._sock, self._events, self._monitor)

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

    # ---- the operations: flows of ClientCore, run here ---------------------------

    request = _awaitable(ClientCore.request)
    request_raw = _awaitable(ClientCore.request_raw)
    submit = _awaitable(ClientCore.submit)
    subscribe = _awaitable(ClientCore.subscribe)
    result = _awaitable(ClientCore.result)
    cancel = _awaitable(ClientCore.cancel)
    status = _awaitable(ClientCore.status)
    run = _awaitable(ClientCore.run)

    async def events(self, call_id: str, *,
                     timeout_s: float | None = None) -> AsyncIterator[dict[str, Any]]:
        """As Client.events, an async iterator."""
        events = self._core.events(call_id, timeout_s)
        while (event := events.take() or await self._call(events.wait())) is not None:
            yield event

    def stream_text(self, provider: str, request: Mapping[str, Any], *, markers: bool = False,
                    timeout_s: float | None = None, detach: bool = False,
                    **submit_kw: Any) -> AsyncTextStream:
        """As Client.stream_text, an async iterator."""
        return AsyncTextStream(self, provider, request, markers, timeout_s, detach, submit_kw)

    # ---- transport: performing the flows' effects ----------------------------------

    async def _call(self, flow: Flow[T]) -> T:
        """Run `flow` to its end; an effect's exception is thrown into it. Then
        send the cancels of calls abandoned meanwhile."""
        self._thread = threading.get_ident()  # the event loop's: where cancels may be sent
        try:
            effect = next(flow)
            while True:
                try:
                    if isinstance(effect, Wait):
                        await self._pump(effect.deadline)
                    else:
                        await self._send(effect)
                except BaseException as exc:
                    effect = flow.throw(exc)
                else:
                    effect = next(flow)
        except StopIteration as stop:
            value: T = stop.value
            return value
        finally:
            if self._core.to_cancel:
                self._send_cancels()

    async def _send(self, effect: Send) -> None:
        self._check_open()
        sock = self._events if effect.to_events else self._sock
        self._sending = True  # pyzmq tries the send at once, frame by frame, in this call
        try:
            sent = sock.send_multipart(effect.frames)
        finally:
            self._sending = False
        try:
            await asyncio.wait_for(sent, self.timeout_s)
        except (TimeoutError, zmq.Again):
            raise self._core.send_failed(effect.what) from None

    def _send_cancels(self) -> None:
        """Send the cancels of abandoned calls now (module docstring)."""
        if (self._sending or self._closed or not self._core.to_cancel
                or threading.get_ident() != self._thread):
            return
        self._sending = True
        try:
            self._core.send_cancels(self._send_now)
        finally:
            self._sending = False

    def _send_now(self, frame: bytes) -> bool:
        try:
            self._sync_sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

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
            if await self._poller.poll(wait_ms):
                await self._route_ready()
        finally:
            async with self._cond:
                self._pumping = False
                self._cond.notify_all()


    async def _route_ready(self) -> None:
        """Route what both sockets hold (events first), up to a reply someone awaits."""
        while True:
            try:
                await self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._core.router.handshake()
        router = self._core.router
        try:
            for sock, route in ((self._events, router.read_events), (self._sock, router.route)):
                while True:
                    try:
                        frames = await sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if route(frames):
                        return
        finally:
            ack = router.ack_due(monotonic())
            if ack is not None:
                with contextlib.suppress(zmq.Again):  # the next one carries the total
                    await self._events.send(ack, zmq.NOBLOCK)


class AsyncTextStream(TextFlow):
    """The asyncio twin of TextStream (`async for`; `async with` or `aclose()` closes it)."""

    def __init__(self, client: AsyncClient, provider: str, request: Mapping[str, Any],
                 markers: bool, timeout_s: float | None, detach: bool,
                 submit_kw: dict[str, Any]) -> None:
        super().__init__(client._core, provider, request, markers, timeout_s, detach,
                         submit_kw)
        self._client = client

    def __aiter__(self) -> AsyncTextStream:
        return self

    async def __anext__(self) -> str:
        piece = await self._client._call(self.next_piece())
        if piece is None:
            raise StopAsyncIteration
        return piece

    def close(self) -> None:
        """As TextStream.close."""
        super().close()
        self._client._send_cancels()

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> AsyncTextStream:
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.close()

    def __del__(self) -> None:
        try:  # noqa: SIM105 (no module global: a finalizer may run at interpreter exit)
            self.close()
        except Exception:
            pass
