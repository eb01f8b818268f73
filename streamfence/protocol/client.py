"""Client library for the streamfence daemon, sync (`Client`) and asyncio (`AsyncClient`).

Transport: one ZeroMQ DEALER socket connected to the daemon's ROUTER
(default tcp://127.0.0.1:7755); every message is one frame holding one msgpack
map with "v": 1 and "op" (docs/PROTOCOL.md). Both classes have the same
methods; the async ones are coroutines and async iterators. Neither is safe to
share between threads; an AsyncClient may be shared by tasks of one loop.

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

Every receive has a deadline: a missing reply raises TimeoutError naming the
request, its ref and the endpoint. Errors: ClientError (the daemon's `error`
reply, code and message as sent), CallFailed (stream_text on a call that
ended failed or cancelled), TimeoutError.

Layout: this module holds the sync `Client` and re-exports the rest;
`client_async` holds `AsyncClient`; `client_router` the I/O-free routing of
what the daemon sends; `client_base` the request builders, the shared base
class, the events() waiting policy and the stream_text iterators.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from time import monotonic
from types import TracebackType
from typing import Any

import zmq

from streamfence.protocol.client_async import AsyncClient
from streamfence.protocol.client_base import (
    DEFAULT_ENDPOINT,
    AsyncTextStream,
    ClientBase,
    EventWatch,
    Options,
    TextStream,
    call_msg,
    expect_reply,
    new_ref,
    raw_ref,
    status_msg,
    submit_msg,
)
from streamfence.protocol.client_router import BAD_REPLY, EVENTS_LOST, CallFailed, ClientError
from streamfence.protocol.codec import DEFAULT_MAX_FRAME, encode
from streamfence.protocol.messages import Op

__all__ = ["BAD_REPLY", "DEFAULT_ENDPOINT", "EVENTS_LOST", "AsyncClient", "AsyncTextStream",
           "CallFailed", "Client", "ClientError", "TextStream"]


class Client(ClientBase):
    """Synchronous client. Use as a context manager or call close()."""

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, timeout_s: float = 10.0, *,
                 context: zmq.Context[Any] | None = None,
                 max_frame: int = DEFAULT_MAX_FRAME) -> None:
        super().__init__(endpoint, timeout_s, max_frame)
        ctx = context if context is not None else zmq.Context.instance()
        self._sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDTIMEO, max(1, int(self.timeout_s * 1000)))
        try:
            self._sock.connect(endpoint)
        except BaseException:
            self._sock.close(linger=0)
            raise

    def close(self) -> None:
        """Close the socket (linger 0: unsent requests are dropped). Idempotent."""
        if not self._closed:
            self._closed = True
            self._sock.close(linger=0)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # ---- transport --------------------------------------------------------

    def _send(self, frames: Sequence[bytes], what: str) -> None:
        self._check_open()
        try:
            self._sock.send_multipart(frames)
        except zmq.Again:
            raise TimeoutError(f"could not send {what} to {self.endpoint} within "
                               f"{self.timeout_s:g} s") from None

    def _pump(self, deadline: float) -> None:
        """Wait for frames until `deadline`; route those ready, up to a reply someone awaits."""
        self._check_open()
        wait_ms = max(0, math.ceil((deadline - monotonic()) * 1000))
        if not self._sock.poll(wait_ms, zmq.POLLIN):
            return
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if self._router.route(frames):
                return

    def _exchange(self, msg: dict[str, Any], what: str, timeout_s: float) -> dict[str, Any]:
        ref: str = msg["ref"]
        self._router.expect(ref)
        try:
            self._send([encode(msg)], what)
            deadline = monotonic() + timeout_s
            while (reply := self._router.take_reply(ref)) is None:
                if monotonic() >= deadline:
                    raise self._no_reply(what, ref, timeout_s)
                self._pump(deadline)
            return reply
        finally:
            self._router.forget(ref)

    # ---- requests ---------------------------------------------------------

    def request(self, msg: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """Send `msg` as is (no validation) and return the reply with its `ref`.

        If `msg` has no usable ref (missing, not a string, too long) the
        daemon can only answer with ref nil: that answer is returned.
        """
        timeout = self._timeout(timeout_s)
        ref = raw_ref(msg)
        if ref is None:
            return self.request_raw(encode(msg), timeout)
        return self._exchange(msg, f"{msg.get('op')!r} request", timeout)

    def request_raw(self, frames: bytes | Sequence[bytes],
                    timeout_s: float | None = None) -> dict[str, Any]:
        """Send raw frame(s) and return the next reply the daemon could not
        attribute to a ref (an `error` with ref nil: bad_frame, too_large...)."""
        timeout = self._timeout(timeout_s)
        parts = [frames] if isinstance(frames, bytes) else list(frames)
        self._router.expect_raw()
        try:
            self._send(parts, "a raw message")
            deadline = monotonic() + timeout
            while (reply := self._router.take_unattributed()) is None:
                if monotonic() >= deadline:
                    raise self._no_reply("a raw message", None, timeout)
                self._pump(deadline)
            return reply
        except BaseException:
            self._router.forget_raw()
            raise

    def submit(self, provider: str, request: Mapping[str, Any], *, session_id: str | None = None,
               idempotency_key: str | None = None, options: Options | None = None,
               subscribe: bool = True) -> str:
        """Submit a call; return its call_id once the daemon journaled it.

        `request` is the provider-native body without `stream`. With
        `subscribe` (the default) its events flow to `events(call_id)`.
        Raises ClientError on an `error` reply (or locally, for a message
        the daemon would refuse: the same validation runs here first).
        """
        ref = new_ref()
        msg = submit_msg(ref, provider, request, session_id=session_id,
                         idempotency_key=idempotency_key, options=options, subscribe=subscribe)
        reply = expect_reply(self._exchange(msg, "submit", self.timeout_s), (Op.ACCEPTED,),
                             "submit")
        call_id = reply.get("call_id")
        if not isinstance(call_id, str):
            raise ClientError(BAD_REPLY, f"accepted without a call_id: {reply!r}", reply)
        if subscribe:
            self._router.reading(call_id, 0)
        return call_id

    def subscribe(self, call_id: str, from_seq: int = 0) -> None:
        """Ask for the call's events after `from_seq` (replay, then live).

        Sends and returns: the daemon does not acknowledge a subscribe; its
        events (or its error) come through `events(call_id)`.
        """
        ref = new_ref()
        msg = call_msg(Op.SUBSCRIBE, ref, call_id, from_seq=from_seq)
        self._router.subscribing(ref, call_id, from_seq)
        self._send([encode(msg)], f"subscribe of call {call_id}")

    def events(self, call_id: str, *, timeout_s: float | None = None) -> Iterator[dict[str, Any]]:
        """Yield the call's events (delta, reset) in seq order, then its done, then stop.

        `timeout_s` is the longest silence allowed between two events
        (TimeoutError naming the call); None: no limit while the daemon
        answers the liveness probes sent every `self.timeout_s` of silence
        (see client_base.EventWatch). The call must be subscribed (submit
        does it by default). Ends at once for a call whose done was handed
        out already; subscribe again to replay it.
        """
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
                self.subscribe(call_id, gap_from)
            if watch.due(monotonic(), self.last_seq(call_id)):
                self.subscribe(call_id, self.last_seq(call_id))
                try:
                    reply = self.result(call_id)
                except TimeoutError as exc:
                    raise watch.probe_failed(exc, self.last_seq(call_id)) from None
                done = watch.probed(monotonic(), reply, self.last_seq(call_id))
                if done is not None:
                    self._router.deliver(done)
                continue
            self._pump(watch.deadline())

    def result(self, call_id: str, wait_s: float = 0.0) -> dict[str, Any] | None:
        """The call's done event (waiting up to wait_s at the daemon), or None if pending."""
        reply = expect_reply(
            self._exchange(call_msg(Op.RESULT, new_ref(), call_id, wait_s=wait_s),
                           f"result of call {call_id}", wait_s + self.timeout_s),
            (Op.DONE, Op.PENDING), f"result of call {call_id}")
        return reply if reply["op"] == Op.DONE else None

    def cancel(self, call_id: str) -> dict[str, Any]:
        """Cancel the call. Returns the `cancelling` reply (the call's done, status
        cancelled, follows to subscribers), or the call's `done` event (with the
        ref) if it had already ended."""
        return expect_reply(
            self._exchange(call_msg(Op.CANCEL, new_ref(), call_id), f"cancel of call {call_id}",
                           self.timeout_s), (Op.CANCELLING, Op.DONE), f"cancel of call {call_id}")

    def status(self) -> dict[str, Any]:
        """The daemon's `status_reply`: workers, calls, breakers, counters."""
        return expect_reply(self._exchange(status_msg(new_ref()), "status", self.timeout_s),
                            (Op.STATUS_REPLY,), "status")

    def stream_text(self, provider: str, request: Mapping[str, Any], *, markers: bool = False,
                    timeout_s: float | None = None, **submit_kw: Any) -> TextStream:
        """Submit (on first iteration) and yield the text deltas as they arrive.

        With `markers`, resets and notices are yielded as bracketed lines.
        After the loop `.done` is the done event; failed/cancelled raises
        CallFailed. `submit_kw` are submit's keywords (not `subscribe`).
        """
        return TextStream(lambda: self.submit(provider, request, subscribe=True, **submit_kw),
                          lambda cid: self.events(cid, timeout_s=timeout_s), markers)

    def run(self, provider: str, request: Mapping[str, Any], *, timeout_s: float | None = None,
            **submit_kw: Any) -> dict[str, Any]:
        """Submit and return the call's done event, whatever its status."""
        call_id = self.submit(provider, request, subscribe=True, **submit_kw)
        for event in self.events(call_id, timeout_s=timeout_s):
            if event["op"] == Op.DONE:
                return event
        raise ClientError(BAD_REPLY, f"the events of call {call_id} ended without a done")
