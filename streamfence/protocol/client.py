"""Client library for the streamfence daemon, sync (`Client`) and asyncio (`AsyncClient`).

Transport: a ZeroMQ DEALER socket connected to the daemon's ROUTER
(default tcp://127.0.0.1:7755) for requests and replies, and a second DEALER
connected to the daemon's events endpoint (the port + 1, or the ipc path +
".events") where the calls' events arrive; every message is one frame
holding one msgpack map with "v": 1 and "op" (docs/PROTOCOL.md). Both classes have the same
methods; the async ones are coroutines and async iterators. Neither is safe to
share between threads; an AsyncClient may be shared by tasks of one loop.

Identity: a daemon with CURVE authentication (the default) hears a client
only with registered credentials (docs/SECURITY.md): `Client(credentials=PATH)`
uses a credentials file (and its endpoint unless one is given); without it,
$STREAMFENCE_CREDENTIALS names one if set. The daemon refuses the handshake
of an unregistered key (and gives no reply to one revoked after it
connected).

Until its first handshake the client watches its connection
(`client_monitor`): a request then fails within a second with
NoConnection, a TimeoutError naming why (no daemon at the endpoint, a
refused key, no credentials for a CURVE daemon, credentials of another
daemon).

Requests and the replies the daemon sends (every reply echoes the request's
`ref`, a fresh uuid4 hex per request, and is matched by it):

    submit     -> {"op": "accepted", "ref", "call_id", "duplicate": bool}
                  (duplicate: an earlier call had the same idempotency_key;
                  its call_id is returned and nothing new starts)
    subscribe  -> no reply on success: the call's events follow, replayed
                  from the store after `from_seq`, then live. A failure
                  (e.g. unknown_call) comes as an error with the subscribe's
                  ref and is raised by `events()`.
    result     -> the call's `done` event with the ref, or
                  {"op": "pending", "ref", "call_id"} if it has not ended
                  within wait_s
    cancel     -> {"op": "cancelling", "ref", "call_id"}; the call's `done`
                  (status "cancelled") follows to its subscribers. For a call
                  that had already ended: its `done` event, with the ref.
    status     -> {"op": "status_reply", "ref", ...}: workers, calls,
                  breakers, counters
    usage      -> {"op": "usage_reply", "ref", "rows", "budgets", ...}
    any        -> {"op": "error", "ref", "code", "message"} (ClientError);
                  ref is nil when the daemon could not read the request's
                  ref (bad_frame, too_large, a missing or invalid ref)

Events pushed to a subscriber carry no ref, and a per-call `seq` 1, 2, 3...:

    {"op": "delta", "call_id", "attempt", "seq", "kind", "data"}
    {"op": "reset", "call_id", "attempt", "seq"}
    {"op": "done",  "call_id", "seq", "status", "response", "error", "attempts"}

They may arrive interleaved with replies to other requests, before the reply
of the submit that started them, or twice (a replay overlapping the live
stream): the client buffers them per call, hands each out once in seq order,
and asks again (subscribe from the last seq) when it sees a gap.

Cancel on abandon: a `stream_text` closed (`close()`, `with`, garbage
collection) or left by an exception before its done, a `run` interrupted
(KeyboardInterrupt, a timeout), and the running calls of both when the
client closes, are cancelled: the cancel is sent without waiting for its
reply, and `close()` lets the request socket linger up to `timeout_s` for
cancels not yet answered. `detach=True` opts out (the call runs on; `result`
reads it). `submit` and `events()` never cancel (client_core's docstring).

Every receive has a deadline: a missing reply raises TimeoutError naming the
request, its ref and the endpoint. Errors: ClientError (the daemon's `error`
reply, code and message as sent), CallFailed (stream_text on a call that
ended failed or cancelled), TimeoutError (NoConnection, sooner, when the
client could not connect).

Layout: the protocol logic is written once, without I/O, in `client_core`
(each operation a flow of `client_effects`), `client_reader` (the events()
policy), `client_shell` (stream_text, what both shells share), `client_base`
(the messages built and the replies accepted), `client_router` (routing
what the daemon sends) and `client_monitor` (why it cannot connect). This
module and `client_async` are shells that run those flows on a socket: the
sync `Client` here (which re-exports the rest), `AsyncClient` there.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator, Mapping
from time import monotonic
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, TypeVar

import zmq

from streamfence.protocol.client_async import AsyncClient
from streamfence.protocol.client_async_text import AsyncTextStream
from streamfence.protocol.client_base import DEFAULT_ENDPOINT
from streamfence.protocol.client_core import ClientCore
from streamfence.protocol.client_effects import Flow, Send, Wait
from streamfence.protocol.client_local import LocalEvents, is_local
from streamfence.protocol.client_monitor import NO_DAEMON_AFTER_S, NoConnection
from streamfence.protocol.client_router import BAD_REPLY, EVENTS_LOST, CallFailed, ClientError
from streamfence.protocol.client_shell import ClientBase, TextFlow, shown_as
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

__all__ = ["BAD_REPLY", "DEFAULT_ENDPOINT", "EVENTS_LOST", "AsyncClient", "AsyncTextStream",
           "CallFailed", "Client", "ClientError", "NoConnection", "TextStream"]

P = ParamSpec("P")
T = TypeVar("T")


def _blocking(flow: Callable[Concatenate[ClientCore, P], Flow[T]]
              ) -> Callable[Concatenate[Client, P], T]:
    """A ClientCore operation as a Client method (same arguments, docstring)."""
    @shown_as(flow)
    def method(self: Client, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._call(flow(self._core, *args, **kwargs))
    return method


class Client(ClientBase):
    """Synchronous client. Use as a context manager or call close()."""

    def __init__(self, endpoint: str | None = None, timeout_s: float = 10.0, *,
                 credentials: Credentials | str | os.PathLike[str] | None = None,
                 context: zmq.Context[Any] | None = None,
                 max_frame: int = DEFAULT_MAX_FRAME) -> None:
        endpoint, creds = resolve(endpoint, credentials, DEFAULT_ENDPOINT)
        super().__init__(endpoint, timeout_s, max_frame, creds)
        ctx = context if context is not None else zmq.Context.instance()
        self._sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        self._events: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        self._events.setsockopt(zmq.ROUTING_ID, self._core.listener.encode())
        self._poller = zmq.Poller()
        self._busy = False  # in an operation or a send: the cancels of abandoned calls wait
        # Each handshake of the events connection (a reconnect: resubscribe),
        # watched before it connects: the first one must be counted.
        self._monitor = self._events.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._link: zmq.Socket[bytes] | None = None  # the request socket's, until it is up
        self._local: LocalEvents | None = None  # the sink's local link, once taken
        self._local_ok = is_local(endpoint)
        try:
            self._link = watch_link(ctx, self._sock, self._core.listener)
            self._poller.register(self._link, zmq.POLLIN)
            for sock, where in ((self._sock, endpoint), (self._events, self._core.events_endpoint)):
                sock.setsockopt(zmq.LINGER, 0)
                if creds is not None:
                    creds.apply(sock)
                sock.setsockopt(zmq.SNDTIMEO, max(1, int(self.timeout_s * 1000)))
                sock.connect(where)
                self._poller.register(sock, zmq.POLLIN)
        except BaseException:
            close_sockets(self._sock, self._events, self._monitor, self._link)
            raise

    def close(self) -> None:
        """Cancel the calls of the client's unfinished stream_text / run (not detached),
        then close the sockets: linger 0 (unsent requests are dropped), but the
        request socket lingers up to timeout_s while a cancel is unanswered. Idempotent."""
        if not self._closed:
            self._core.leave_all()
            self._busy = False  # closing from inside an operation (a signal handler, say)
            self._send_cancels()
            self._closed = True
            self._unlink()
            self._drop_local()
            linger_ms = self._core.closing()
            if linger_ms:
                self._sock.close(linger=linger_ms)  # close_sockets then finds it closed
            close_sockets(self._sock, self._events, self._monitor, None)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # ---- the operations: flows of ClientCore, run here ---------------------------

    request = _blocking(ClientCore.request)
    request_raw = _blocking(ClientCore.request_raw)
    submit = _blocking(ClientCore.submit)
    subscribe = _blocking(ClientCore.subscribe)
    result = _blocking(ClientCore.result)
    cancel = _blocking(ClientCore.cancel)
    status = _blocking(ClientCore.status)
    usage = _blocking(ClientCore.usage)
    calls = _blocking(ClientCore.calls)
    run = _blocking(ClientCore.run)

    def events(self, call_id: str, *, timeout_s: float | None = None) -> Iterator[dict[str, Any]]:
        """Yield the call's events (delta, reset) in seq order, then its done, then stop.

        `timeout_s` is the longest silence allowed between two events
        (TimeoutError naming the call); None: no limit while the daemon
        answers the liveness probes sent every `self.timeout_s` of silence
        (see client_reader.EventReader). The call must be subscribed (submit
        does it by default). Ends at once for a call whose done was handed
        out already; subscribe again to replay it.
        """
        events = self._core.events(call_id, timeout_s)
        while (event := events.take() or self._call(events.wait())) is not None:
            yield event

    def stream_text(self, provider: str, request: Mapping[str, Any], *, markers: bool = False,
                    timeout_s: float | None = None, detach: bool = False,
                    **submit_kw: Any) -> TextStream:
        """Submit (on first iteration) and yield the text deltas as they arrive.

        With `markers`, resets and notices are yielded as bracketed lines.
        After the loop `.done` is the done event; failed/cancelled raises
        CallFailed. `submit_kw` are submit's keywords (not `subscribe`).
        Closed (`close()`, `with`, garbage collected) or left by an exception
        before the done, the call is cancelled, unless `detach`: then it runs
        on, and `result(stream.call_id)` reads its outcome.
        """
        return TextStream(self, provider, request, markers, timeout_s, detach, submit_kw)

    # ---- transport: performing the flows' effects ----------------------------------

    def _call(self, flow: Flow[T]) -> T:
        """Run `flow` to its end; an effect's exception is thrown into it. Then
        send the cancels of calls abandoned meanwhile."""
        busy, self._busy = self._busy, True
        try:
            effect = next(flow)
            while True:
                try:
                    if isinstance(effect, Wait):
                        self._pump(effect.deadline)
                    else:
                        self._send(effect)
                except BaseException as exc:
                    effect = flow.throw(exc)
                else:
                    effect = next(flow)
        except StopIteration as stop:
            value: T = stop.value
            return value
        finally:
            self._busy = busy
            if self._core.to_cancel:
                self._send_cancels()

    def _send_cancels(self) -> None:
        """Send the cancels of abandoned calls (client_core.ClientCore.send_cancels),
        unless an operation is under way (a stream collected in the middle of one,
        or in another thread): that one sends them when it ends."""
        if self._busy or self._closed or not self._core.to_cancel:
            return
        self._busy = True
        try:
            self._core.send_cancels(self._send_now)
        finally:
            self._busy = False

    def _send_now(self, frame: bytes) -> bool:
        try:
            self._sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def _send(self, effect: Send) -> None:
        self._check_open()
        sock = self._events if effect.to_events else self._sock
        if self._link is not None:
            self._send_watching(sock, effect)
            return
        try:
            sock.send_multipart(effect.frames)  # blocks up to SNDTIMEO (timeout_s)
        except zmq.Again:
            raise self._core.send_failed(effect.what) from None

    def _send_watching(self, sock: zmq.Socket[bytes], effect: Send) -> None:
        """A send before the link is up. libzmq drops the queue of a connection whose
        handshake was refused, and a blocking send would then wait timeout_s: so it
        waits on the link's monitor too, and raises NoConnection once it tells."""
        since = monotonic()
        deadline = since + self.timeout_s
        while True:
            try:
                sock.send_multipart(effect.frames, zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
            if self._link is None:  # up meanwhile: an ordinary send now
                self._send(effect)
                return
            self._read_link()
            now = monotonic()
            self._core.link.check(since, now)
            if now >= deadline:
                raise self._core.send_failed(effect.what)
            if self._link is not None:
                zmq.select([self._link], [sock], [], min(deadline - now, NO_DAEMON_AFTER_S))

    def _pump(self, deadline: float) -> None:
        """Wait for frames until `deadline`; route those ready (events first, then
        replies), up to a reply someone awaits. It reads only the sockets the
        poll reported (each until it runs dry): at a model's pace a wake-up
        brings one event, and every other socket looked at would cost
        system calls and a zmq.Again of its own (docs/PERFORMANCE.md, issue 32)."""
        self._check_open()
        wait_ms = max(0, math.ceil((deadline - monotonic()) * 1000))
        ready = self._poller.poll(wait_ms)
        if not ready:
            return
        local = self._local
        if local is not None and any(sock == local.fileno() for sock, _ in ready):
            self._read_local()
        if self._link is not None:
            self._read_link()
        events = requests = False
        for sock, _ in ready:
            if sock is self._events:
                events = True
            elif sock is self._sock:
                requests = True
            elif sock is self._monitor:
                while self._monitor.poll(0):
                    self._monitor.recv_multipart()
                    self._core.router.handshake()
        router = self._core.router
        router.woken.clear()  # one flow at a time here: whoever waits looks
        try:
            if events and self._drain(self._events, router.read_events):
                return
            if requests:
                self._drain(self._sock, router.route)
        finally:
            self._send_ack()
            if router.link_offer is not None:
                self._take_offer()

    def _send_ack(self) -> None:
        ack = self._core.router.ack_due(monotonic())
        if ack is not None:
            with contextlib.suppress(zmq.Again):  # the next one carries the total
                self._events.send(ack, NOBLOCK)

    def _take_offer(self) -> None:
        """The sink offered a local link (client_local.py): take it, if none is
        up and the daemon is on this host, before any request names the listener."""
        router = self._core.router
        offer, router.link_offer = router.link_offer, None
        if self._local is None and self._local_ok:
            self._local = LocalEvents.attach(offer, self._core.router.max_frame)
            if self._local is not None:
                self._poller.register(self._local.fileno(), zmq.POLLIN)
                self._read_local()

    def _read_local(self) -> None:
        """Route what the local link holds; if it ended, drop it: a reconnect."""
        assert self._local is not None
        if not self._local.read(self._core.router):
            self._drop_local()
            self._core.router.handshake()
        self._send_ack()

    def _drop_local(self) -> None:
        if self._local is not None:
            with contextlib.suppress(KeyError):
                self._poller.unregister(self._local.fileno())
            self._local.close()
            self._local = None

    @staticmethod
    def _drain(sock: zmq.Socket[bytes], route: Callable[[list[bytes]], bool]) -> bool:
        """Route what `sock` holds; True (and stop) at a reply someone awaits.
        Its state is looked at before each receive: a zmq.Again per pass costs
        more than the look."""
        while has_message(sock):
            if route(receive(sock)):
                return True
        return False

    def _read_link(self) -> None:
        """Tell the core what the request socket's monitor saw (client_monitor);
        once the link is up, stop watching it."""
        assert self._link is not None
        for event, value in link_events(self._link):
            self._core.link.saw(event, value)
        if self._core.link.up:
            self._unlink()

    def _unlink(self) -> None:
        if self._link is not None:
            self._poller.unregister(self._link)
            stop_watch(self._sock, self._link)
            self._link = None


class TextStream(TextFlow):
    """Iterator over the text of one call; submits on the first `next()`.

    After the iteration, `done` holds the call's done event; `call_id` is set
    once the call was accepted. A call that ends `failed` or `cancelled`
    raises CallFailed at the end of the iteration (after its text).
    `close()` (also `with` and garbage collection) before the done cancels
    the call, unless `detach`.
    """

    def __init__(self, client: Client, provider: str, request: Mapping[str, Any],
                 markers: bool, timeout_s: float | None, detach: bool,
                 submit_kw: dict[str, Any]) -> None:
        super().__init__(client._core, provider, request, markers, timeout_s, detach,
                         submit_kw)
        self._client = client

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> str:
        piece = self._client._call(self.next_piece())
        if piece is None:
            raise StopIteration
        return piece

    def close(self) -> None:
        """Stop reading; a call not done is cancelled (unless `detach`), the cancel
        sent at once without waiting for its reply. Idempotent."""
        super().close()
        self._client._send_cancels()

    def __enter__(self) -> TextStream:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __del__(self) -> None:
        try:  # noqa: SIM105 (no module global: a finalizer may run at interpreter exit)
            self.close()
        except Exception:
            pass
