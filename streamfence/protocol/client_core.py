"""The client's protocol logic, once and without I/O: what `Client` and `AsyncClient` run.

`ClientCore` holds the settings and the Router and runs every client
operation as a flow (client_effects.py: a generator yielding the I/O it
needs); `run` assembles an answer whose done event omits its content.
Reading a call's events is client_reader.py's `EventReader`; what the two
shells share besides (`ClientBase`, `stream_text`'s `TextFlow`) is
client_shell.py.

Two sockets, one endpoint to configure (docs/PROTOCOL.md §1): requests go to
the client endpoint; the calls' events come from the daemon's events
endpoint (`messages.events_endpoint`), where the client's DEALER has its
`listener` id (a fresh secret) as routing id. Before the first request that
names the listener, the client says `listen` there and waits for
`listening`, so its events connection is up before events are sent to it.

Cancel on abandon: a call that `stream_text` or `run` submitted (without
`detach`) is *owned* until its done. Left before that (the stream closed or
collected, an exception or interrupt out of `run`, the client closed), it
is cancelled: `leave` queues the cancel (no I/O) and the shell sends it
without waiting for the reply (`send_cancels`): at once where that is safe
(not inside a send of the same socket, not from another thread), else when
the current operation ends, at the latest on close. A call of `submit` or
read with `events()` is never cancelled by the client: its reader may be one
of several, and its caller holds the id.

A flow waiting for an answer asks `link` (client_monitor.LinkWatch, fed by
the shell until the first handshake) whether one can come at all, and
raises its NoConnection at once if not.

Deadlines are `time.monotonic()` values, the only clock read here. What to
send, which reply ops are valid, what to raise, when `events()` re-subscribes
or probes and what `stream_text` yields are all decided here, in
client_reader.py, client_shell.py and client_base.py; the shells hold no
protocol logic. An operation added to
`ClientCore` becomes a method of each shell by one line
(`name = _blocking(ClientCore.name)` in client.py, `_awaitable` in client_async.py).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from time import monotonic
from typing import Any

from streamfence.protocol.client_base import (
    Options,
    accepted_call_id,
    call_msg,
    calls_msg,
    expect_reply,
    listen_msg,
    new_ref,
    raw_ref,
    status_msg,
    submit_msg,
    usage_msg,
)
from streamfence.protocol.client_effects import Flow, Send, Wait
from streamfence.protocol.client_monitor import LinkWatch
from streamfence.protocol.client_reader import EventReader
from streamfence.protocol.client_router import BAD_REPLY, LISTENING, ClientError, Router
from streamfence.protocol.codec import encode
from streamfence.protocol.credentials import Credentials
from streamfence.protocol.messages import Op, events_endpoint

log = logging.getLogger("streamfence.client")


class ClientCore:
    """Settings, the Router, and the flow of every client operation."""

    def __init__(self, endpoint: str, timeout_s: float, max_frame: int,
                 credentials: Credentials | None = None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self.endpoint = endpoint
        self.link = LinkWatch(endpoint, credentials)  # why no answer comes (client_monitor)
        self.events_endpoint = events_endpoint(endpoint)
        self.listener = new_ref()  # the events socket's routing id: a secret (uuid4 hex)
        self.timeout_s = float(timeout_s)
        self.router = Router(max_frame)
        self.subscribes = 0  # subscribe requests sent (a gap, a cut_off, a probe, the caller)
        self.owned: set[str] = set()  # calls of stream_text / run, not detached, before done
        self.to_cancel: deque[str] = deque()  # abandoned calls whose cancel is not sent yet

    def send_failed(self, what: str) -> TimeoutError:
        return TimeoutError(f"could not send {what} to {self.endpoint} within "
                            f"{self.timeout_s:g} s")

    # ---- cancel on abandon (module docstring) -------------------------------------

    def leave(self, call_id: str) -> None:
        """The caller reads no more of `call_id`: its events are dropped and, if
        this client owns it, its cancel is queued for `send_cancels`."""
        self.router.stop_reading(call_id)
        if call_id in self.owned:
            self.owned.discard(call_id)
            self.to_cancel.append(call_id)

    def leave_all(self) -> None:
        """The client closes: every call it owns is abandoned."""
        for call_id in list(self.owned):
            self.leave(call_id)

    def closing(self) -> int:
        """The client closes (after a last `send_cancels`): warn of cancels it could
        not send; return its request socket's linger in ms (timeout_s while a
        cancel is unanswered, so that it still leaves; else 0)."""
        if self.to_cancel:
            log.warning("closing the client of %s with the cancels of calls %s unsent (no "
                        "connection to the daemon): they run on", self.endpoint,
                        ", ".join(self.to_cancel))
        return int(self.timeout_s * 1000) if self.router.cancels_unanswered else 0

    def send_cancels(self, send: Callable[[bytes], bool]) -> None:
        """Send the queued cancels with `send`, a non-blocking send of one frame
        (False: not now; the cancel stays queued for the next time)."""
        while self.to_cancel:
            call_id = self.to_cancel[0]
            ref = new_ref()
            if not send(encode(call_msg(Op.CANCEL, ref, call_id))):
                return
            self.to_cancel.popleft()
            self.router.cancel_sent(ref, call_id)

    def _wait(self, since: float, deadline: float, on: str | None = None) -> Wait:
        """The Wait of a flow waiting since `since` for an answer due by `deadline`;
        raises NoConnection at once if none can come (client_monitor.LinkWatch)."""
        link = self.link
        if link.up:  # the usual case, after the first answer
            return Wait(deadline, on)
        now = monotonic()
        link.check(since, now)
        return Wait(link.wake_at(since, deadline, now), on)

    def _no_reply(self, what: str, ref: str | None, timeout_s: float) -> TimeoutError:
        ref_text = f"ref {ref}" if ref is not None else "no ref"
        return TimeoutError(f"no reply to {what} ({ref_text}) from {self.endpoint} "
                            f"within {timeout_s:g} s")

    def _listen(self) -> Flow[None]:
        """Make sure the events connection is up: until `listening`, say `listen`
        once per connection (Router.listen_due: tasks of an AsyncClient that
        ask at once wait for one answer), and again when the connection is
        made again meanwhile (to a restarted sink: the one that heard it died
        before it answered), each time with timeout_s for the answer."""
        router = self.router
        since = monotonic()
        deadline = since + self.timeout_s
        while not router.listening:
            if router.listen_due():
                router.listen_sent()
                yield Send([encode(listen_msg())], "listen", to_events=True)
                deadline = monotonic() + self.timeout_s
            elif monotonic() >= deadline:
                raise TimeoutError(f"no answer to listen from the events endpoint "
                                   f"{self.events_endpoint} within {self.timeout_s:g} s")
            else:
                yield self._wait(since, deadline, LISTENING)

    def _exchange(self, msg: dict[str, Any], what: str, timeout_s: float) -> Flow[dict[str, Any]]:
        """Send `msg` and return the reply that echoes its ref."""
        ref: str = msg["ref"]
        self.router.expect(ref)
        try:
            yield Send([encode(msg)], what)
            since = monotonic()
            deadline = since + timeout_s
            while (reply := self.router.take_reply(ref)) is None:
                if monotonic() >= deadline:
                    raise self._no_reply(what, ref, timeout_s)
                yield self._wait(since, deadline, ref)
            return reply
        finally:
            self.router.forget(ref)  # a reply arriving after this is discarded

    # ---- the operations (each one a method of Client and AsyncClient) -------------

    def request(self, msg: dict[str, Any], timeout_s: float | None = None) -> Flow[dict[str, Any]]:
        """Send `msg` as is (no validation) and return the reply with its `ref`.

        If `msg` has no usable ref (missing, not a string, too long) the
        daemon can only answer with ref nil: that answer is returned.
        """
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if raw_ref(msg) is None:
            return (yield from self.request_raw(encode(msg), timeout))
        return (yield from self._exchange(msg, f"{msg.get('op')!r} request", timeout))

    def request_raw(self, frames: bytes | Sequence[bytes],
                    timeout_s: float | None = None) -> Flow[dict[str, Any]]:
        """Send raw frame(s) and return the next reply the daemon could not
        attribute to a ref (an `error` with ref nil: bad_frame, too_large...)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        parts = [frames] if isinstance(frames, bytes) else list(frames)
        self.router.expect_raw()
        try:
            yield Send(parts, "a raw message")
            since = monotonic()
            deadline = since + timeout
            while (reply := self.router.take_unattributed()) is None:
                if monotonic() >= deadline:
                    raise self._no_reply("a raw message", None, timeout)
                yield self._wait(since, deadline)
            return reply
        except BaseException:
            self.router.forget_raw()
            raise

    def submit(self, provider: str, request: Mapping[str, Any], *, session_id: str | None = None,
               idempotency_key: str | None = None, options: Options | None = None,
               subscribe: bool = True) -> Flow[str]:
        """Submit a call; return its call_id once the daemon journaled it.

        `request` is the provider-native body without `stream`. With
        `subscribe` (the default) its events flow to `events(call_id)`.
        Raises ClientError on an `error` reply (or locally, for a message
        the daemon would refuse: the same validation runs here first).
        """
        msg = submit_msg(new_ref(), provider, request, session_id=session_id,
                         idempotency_key=idempotency_key, options=options,
                         listener=self.listener if subscribe else None)
        if subscribe:
            yield from self._listen()
        call_id = accepted_call_id((yield from self._exchange(msg, "submit", self.timeout_s)))
        if subscribe:
            if self.router.last_seq(call_id) > 0:
                # A duplicate of a call this client has read events of (live or to its
                # done): its replay from seq 1 may have come (on the other socket) before
                # `accepted`, and was dropped as a repeat; it is read afresh.
                yield from self.subscribe(call_id, 0)
            else:
                self.router.reading(call_id, 0)
        return call_id

    def subscribe(self, call_id: str, from_seq: int = 0) -> Flow[None]:
        """Ask for the call's events after `from_seq` (replay, then live).

        Sends and returns: the daemon does not acknowledge a subscribe; its
        events (or its error) come through `events(call_id)`.
        """
        ref = new_ref()
        msg = call_msg(Op.SUBSCRIBE, ref, call_id, from_seq=from_seq, listener=self.listener)
        self.subscribes += 1
        yield from self._listen()
        self.router.subscribing(ref, call_id, from_seq)
        yield Send([encode(msg)], f"subscribe of call {call_id}")

    def result(self, call_id: str, wait_s: float = 0.0) -> Flow[dict[str, Any] | None]:
        """The call's done event (waiting up to wait_s at the daemon), or None if pending."""
        what = f"result of call {call_id}"
        reply = expect_reply((yield from self._exchange(
            call_msg(Op.RESULT, new_ref(), call_id, wait_s=wait_s), what,
            wait_s + self.timeout_s)), (Op.DONE, Op.PENDING), what)
        return reply if reply["op"] == Op.DONE else None

    def cancel(self, call_id: str) -> Flow[dict[str, Any]]:
        """Cancel the call. Returns the `cancelling` reply (the call's done, status
        cancelled, follows to subscribers), or the call's `done` event (with the
        ref) if it had already ended. Cluster mode, ClientError `cancel_unknown`:
        the host running it did not answer, and may still cancel it (cancel
        again to learn which); `cluster_unavailable`: nothing was cancelled."""
        what = f"cancel of call {call_id}"
        reply = yield from self._exchange(call_msg(Op.CANCEL, new_ref(), call_id), what,
                                          self.timeout_s)
        return expect_reply(reply, (Op.CANCELLING, Op.DONE), what)

    def status(self) -> Flow[dict[str, Any]]:
        """The daemon's `status_reply`: workers, calls, breakers, counters."""
        reply = yield from self._exchange(status_msg(new_ref()), "status", self.timeout_s)
        return expect_reply(reply, (Op.STATUS_REPLY,), "status")

    def usage(self, by: Sequence[str] | None = None, since: str | None = None
              ) -> Flow[dict[str, Any]]:
        """The daemon's `usage_reply`: the usage sums from UTC day `since`
        (YYYY-MM-DD; None: all) grouped `by` (identity, profile, model, day),
        and the budgets; an identity that is not an admin gets its own."""
        reply = yield from self._exchange(usage_msg(new_ref(), by, since), "usage",
                                          self.timeout_s)
        return expect_reply(reply, (Op.USAGE_REPLY,), "usage")

    def calls(self, *, state: str | None = None, identity: str | None = None,
              provider: str | None = None, search: str | None = None, limit: int | None = None,
              before: str | None = None, call_id: str | None = None) -> Flow[dict[str, Any]]:
        """A page of the calls this identity may see, newest first: the
        `calls_reply` (PROTOCOL "calls"); its `next`, given as `before`, is
        the next page (nil: none). `call_id`: that call alone, with its
        attempts and request."""
        msg = calls_msg(new_ref(), state=state, identity=identity, provider=provider,
                        search=search, limit=limit, before=before, call_id=call_id)
        reply = yield from self._exchange(msg, "calls", self.timeout_s)
        return expect_reply(reply, (Op.CALLS_REPLY,), "calls")

    def events(self, call_id: str, timeout_s: float | None) -> EventReader:
        """The reader behind one `events()` iteration (not a flow: see EventReader)."""
        return EventReader(self, call_id, timeout_s)

    def run(self, /, provider: str, request: Mapping[str, Any], *,
            timeout_s: float | None = None, detach: bool = False,
            **submit_kw: Any) -> Flow[dict[str, Any]]:
        """Submit and return the call's done event, whatever its status.

        An answer too large for the done event (`response.content_omitted`) is
        assembled here from the winning attempt's deltas. Left before the done
        (KeyboardInterrupt, a cancelled task, a timeout, the client closed),
        the call is cancelled, unless `detach`: then it runs on (`result`)."""
        call_id = yield from self.submit(provider, request, subscribe=True, **submit_kw)
        if not detach:
            self.owned.add(call_id)
        events = self.events(call_id, timeout_s)
        answer = _Answer()
        try:
            while (event := events.take() or (yield from events.wait())) is not None:
                if event["op"] == Op.DONE:
                    self.owned.discard(call_id)
                    return answer.fill(event)
                answer.add(event)
        except BaseException:
            self.leave(call_id)  # no I/O here: the shell sends the cancel
            raise
        self.owned.discard(call_id)
        raise ClientError(BAD_REPLY, f"the events of call {call_id} ended without a done")


_ANSWER_FIELDS = {"text": "content", "reasoning": "reasoning", "refusal": "refusal"}


class _Answer:
    """The text deltas of a call's latest attempt, for a done event whose
    response omits them (`content_omitted`, PROTOCOL §6)."""

    def __init__(self) -> None:
        self.attempt = 0
        self.parts: dict[str, list[str]] = {field: [] for field in _ANSWER_FIELDS.values()}

    def add(self, event: Mapping[str, Any]) -> None:
        attempt = event.get("attempt", 0)
        if attempt != self.attempt:  # a new attempt: the response is its content only
            self.attempt = attempt
            for parts in self.parts.values():
                parts.clear()
        field = _ANSWER_FIELDS.get(event.get("kind", ""))
        if event["op"] == Op.DELTA and field is not None and isinstance(event.get("data"), str):
            self.parts[field].append(event["data"])

    def fill(self, done: dict[str, Any]) -> dict[str, Any]:
        response = done.get("response")
        if not isinstance(response, dict) or not response.get("content_omitted"):
            return done
        response = {**response, "content": "".join(self.parts["content"]),
                    "reasoning": "".join(self.parts["reasoning"]),
                    "refusal": "".join(self.parts["refusal"]) or None}
        return {**done, "response": response}
