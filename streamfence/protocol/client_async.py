"""The asyncio flavour of the client: `AsyncClient`.

Same methods, arguments and replies as `streamfence.protocol.client.Client`
(see that module for the protocol each method speaks): both run the flows of
`client_core.ClientCore`. The requests are coroutines, `events()` and
`stream_text()` are async iterators, `close()` stays a plain method.

Receiving is done by the event loop, not by a task: the client's three
sockets (requests, events, the events socket's monitor) are plain zmq
sockets whose file descriptors the loop watches (`add_reader`). When the
monitor's is, `_handshakes` wakes every flow (a reconnect); when another
one is, `_readable` routes everything that socket holds through the shared
Router and wakes only the flows waiting for what came (`Wait.on`: a ref, a
call id), so a gateway serving many streams on one client runs one callback
per batch and one task per event, not every task per batch. A zmq socket's
descriptor signals edges ("something changed"), not levels: a send or
receive may swallow the edge of a message that arrives meanwhile, so each
such operation is followed by a check of the socket's state (`_recheck`),
and a routing pass ends only when the socket has nothing more.

A local events link (client_local.py), once taken, is one more descriptor
the loop watches (`_read_local`), read and routed as the events socket is.

Cancel on abandon (client_core's docstring): the cancel of an abandoned call
is sent at once, without an await, except in the middle of a send or off
the client's thread (a finalizer run by another thread's garbage
collection): then when the current operation ends.
`AsyncTextStream.close()` is a plain method, `aclose()` its awaitable
twin (`contextlib.aclosing`), and `async with` closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from time import monotonic
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, TypeVar

import zmq

from streamfence.protocol.client_async_text import AsyncTextStream
from streamfence.protocol.client_base import DEFAULT_ENDPOINT
from streamfence.protocol.client_core import ClientCore
from streamfence.protocol.client_effects import Flow, Send, Wait
from streamfence.protocol.client_local import LocalEvents, is_local
from streamfence.protocol.client_router import ANY, ClientError
from streamfence.protocol.client_shell import ClientBase, shown_as
from streamfence.protocol.client_sockets import (
    NOBLOCK,
    close_sockets,
    has_message,
    link_events,
    receive,
    stop_watch,
    watch_link,
)
from streamfence.protocol.codec import DEFAULT_MAX_FRAME
from streamfence.protocol.credentials import Credentials, resolve

SEND_RETRY_S = 0.005  # a send refused by a full queue (high-water mark) is tried again after

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
                 context: zmq.Context[Any] | None = None,
                 max_frame: int = DEFAULT_MAX_FRAME) -> None:
        endpoint, creds = resolve(endpoint, credentials, DEFAULT_ENDPOINT)
        super().__init__(endpoint, timeout_s, max_frame, creds)
        ctx = context if context is not None else zmq.Context.instance()
        # Plain sockets even from a zmq.asyncio context: the loop watches them (module docstring).
        self._sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER, socket_class=zmq.Socket)
        self._events: zmq.Socket[bytes] = ctx.socket(zmq.DEALER, socket_class=zmq.Socket)
        self._events.setsockopt(zmq.ROUTING_ID, self._core.listener.encode())
        self._monitor: zmq.Socket[bytes] = ctx.socket(zmq.PAIR, socket_class=zmq.Socket)
        self._link: zmq.Socket[bytes] | None = None  # the request socket's, until it is up
        self._local: LocalEvents | None = None  # the sink's local link, once taken
        self._local_ok = is_local(endpoint)
        try:
            self._link = watch_link(ctx, self._sock, self._core.listener)
            # Each handshake of the events connection (a reconnect: resubscribe),
            # watched before it connects: the first one must be counted.
            where = f"inproc://streamfence-monitor-{self._core.listener}"
            self._events.monitor(where, zmq.EVENT_HANDSHAKE_SUCCEEDED)
            self._monitor.connect(where)
            for sock, where in ((self._sock, endpoint), (self._events, self._core.events_endpoint)):
                sock.setsockopt(zmq.LINGER, 0)
                if creds is not None:
                    creds.apply(sock)
                sock.connect(where)
        except BaseException:
            close_sockets(self._sock, self._events, self._monitor, self._link)
            raise
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop watching the sockets
        self._waiting: dict[str, list[asyncio.Future[None]]] = {}  # Wait.on (or ANY) -> flows
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
            self._unwatch()
            self._unlink()
            self._drop_local()
            if linger_ms:
                self._sock.close(linger=linger_ms)  # close_sockets then finds it closed
            close_sockets(self._sock, self._events, self._monitor, None)
            self._wake(None)  # the flows waiting find the client closed

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
    usage = _awaitable(ClientCore.usage)
    calls = _awaitable(ClientCore.calls)
    run = _awaitable(ClientCore.run)

    async def events(self, call_id: str, *,
                     timeout_s: float | None = None) -> AsyncIterator[dict[str, Any]]:
        """As Client.events, an async iterator."""
        events = self._core.events(call_id, timeout_s)
        while (event := events.take() or await self._call(events.wait())) is not None:
            yield event

    async def event_batches(self, call_id: str, *, timeout_s: float | None = None
                            ) -> AsyncIterator[list[dict[str, Any]]]:
        """As events(), but each step yields every event buffered by then (those
        that came together), in order: the gateway writes them in one send."""
        events = self._core.events(call_id, timeout_s)
        while (event := events.take() or await self._call(events.wait())) is not None:
            batch = [event]
            while (event := events.take()) is not None:
                batch.append(event)
            yield batch

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
                        await self._wait(effect)
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
        loop = self._watch()
        sock = self._events if effect.to_events else self._sock
        deadline = monotonic() + self.timeout_s
        self._sending = True
        try:
            while True:
                try:
                    sock.send_multipart(effect.frames, zmq.NOBLOCK)
                    break
                except zmq.Again:  # the queue to the daemon is full: rare, so polled
                    now = monotonic()
                    # ... or gone with a refused handshake: the link says why (client_monitor)
                    self._core.link.check(deadline - self.timeout_s, now)
                    if now >= deadline:
                        raise self._core.send_failed(effect.what) from None
                await asyncio.sleep(SEND_RETRY_S)
                self._check_open()
        finally:
            self._sending = False
        self._recheck(loop, sock)

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
        if self._loop is not None:
            self._recheck(self._loop, self._sock)

    def _send_now(self, frame: bytes) -> bool:
        try:
            self._sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    async def _wait(self, wait: Wait) -> None:
        """Until the router marks `wait.on` woken (any message, for None), or
        `wait.deadline`."""
        self._check_open()
        loop = self._watch()
        delay = wait.deadline - monotonic()
        if delay <= 0:
            return
        key = ANY if wait.on is None else wait.on
        waiter = loop.create_future()
        self._waiting.setdefault(key, []).append(waiter)
        timer = loop.call_later(delay, _resolve, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            waiters = self._waiting.get(key)
            if waiters is not None and waiter in waiters:
                waiters.remove(waiter)
                if not waiters:
                    del self._waiting[key]

    # ---- receiving: the loop's reader callback ------------------------------------

    def _watch(self) -> asyncio.AbstractEventLoop:
        """The running loop, watching the sockets (moved to it if the client was
        used on another loop before)."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._unwatch()
            loop.add_reader(self._monitor.FD, self._handshakes)
            # Not only what came before: until the monitor's state is read once, a
            # handshake reported to it raises no edge on its descriptor at all.
            loop.call_soon(self._handshakes)
            if self._link is not None:
                loop.add_reader(self._link.FD, self._read_link)
                loop.call_soon(self._read_link)
            if self._local is not None:
                loop.add_reader(self._local.fileno(), self._read_local)
            for sock in (self._events, self._sock):
                loop.add_reader(sock.FD, self._readable, sock)
                loop.call_soon(self._readable, sock)  # what came before anyone watched
            self._loop = loop
        return loop

    def _unwatch(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            for sock in (self._sock, self._events, self._monitor, self._link):
                if sock is not None:
                    loop.remove_reader(sock.FD)
            if self._local is not None:
                loop.remove_reader(self._local.fileno())

    def _recheck(self, loop: asyncio.AbstractEventLoop, sock: zmq.Socket[bytes]) -> None:
        """After an operation on `sock`: its descriptor's edge may be spent, so
        look at its state (module docstring)."""
        if not loop.is_closed() and has_message(sock):
            loop.call_soon(self._readable, sock)

    def _readable(self, sock: zmq.Socket[bytes]) -> None:
        """A socket's reader: route what it holds, up to a reply someone awaits,
        and wake the flows it was for."""
        if self._closed:
            return
        router = self._core.router
        events = sock is self._events
        route = router.read_events if events else router.route
        answered = False
        try:
            # The socket's state is read before each receive: an exception (zmq.Again)
            # per pass costs more than the look.
            while not answered and has_message(sock):
                answered = route(receive(sock))
            ack = router.ack_due(monotonic()) if events else None
            if ack is not None:
                with contextlib.suppress(zmq.Again):  # the next one carries the total
                    sock.send(ack, NOBLOCK)
                answered = True  # the send may have spent the socket's edge
        except ClientError as exc:  # the daemon broke the protocol: every waiting flow hears
            router.woken.clear()
            self._wake(None, exc)
            return
        if events and router.link_offer is not None:
            self._take_offer()
        woken, router.woken = router.woken, set()
        self._wake(woken)
        if answered and self._loop is not None:
            # The flow that got its reply acts on it first (Router.route); then the rest.
            self._loop.call_soon(self._readable, sock)

    def _take_offer(self) -> None:
        """As Client._take_offer (client_local.py): before the flow waiting for
        `listening` runs (it is woken after this)."""
        router = self._core.router
        offer, router.link_offer = router.link_offer, None
        if self._local is None and self._local_ok:
            self._local = LocalEvents.attach(offer, router.max_frame)
            if self._local is not None and self._loop is not None:
                self._loop.add_reader(self._local.fileno(), self._read_local)
                self._loop.call_soon(self._read_local)  # what came with its answer

    def _read_local(self) -> None:
        """The local link's reader: route what it holds, then ack and wake as
        `_readable` does; a link that ended is dropped (a reconnect)."""
        if self._closed or self._local is None:
            return
        try:
            if not self._local.read(self._core.router):
                self._drop_local()
                self._core.router.handshake()
                self._wake(None)
                return
        except ClientError as exc:
            self._core.router.woken.clear()
            self._wake(None, exc)
            return
        self._readable(self._events)

    def _drop_local(self) -> None:
        local, self._local = self._local, None
        if local is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(local.fileno())
            local.close()

    def _handshakes(self) -> None:
        """The monitor's reader: each handshake of the events connection after the
        first is a reconnect, and every reader resubscribes (Router.handshake)."""
        if self._closed:
            return
        shook = False
        while has_message(self._monitor):
            receive(self._monitor)
            self._core.router.handshake()
            shook = True
        if shook:
            self._wake(None)

    def _read_link(self) -> None:
        """The reader of the request socket's monitor: tell the core what it saw
        (client_monitor) and wake every flow to look; once the link is up, stop
        watching it."""
        if self._closed or self._link is None:
            return
        seen = link_events(self._link)
        for event, value in seen:
            self._core.link.saw(event, value)
        if self._core.link.up:
            self._unlink()
        if seen:
            self._wake(None)

    def _unlink(self) -> None:
        link, self._link = self._link, None
        if link is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(link.FD)
            stop_watch(self._sock, link)

    def _wake(self, keys: set[str] | None, error: BaseException | None = None) -> None:
        """Wake the flows waiting on `keys` (None: all of them)."""
        if not self._waiting:
            return
        if keys is None:
            woken = list(self._waiting)
        else:
            woken = [key for key in keys if key in self._waiting]
            if keys and ANY in self._waiting:
                woken.append(ANY)
        for key in woken:
            for waiter in self._waiting.pop(key, ()):
                if not waiter.done():
                    if error is None:
                        waiter.set_result(None)
                    else:
                        waiter.set_exception(error)


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
