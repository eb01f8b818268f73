"""The client's protocol logic, once and without I/O: what `Client` and `AsyncClient` run.

Each operation is a *flow*: a generator that builds the request, yields the
I/O it needs as effects, and returns the interpreted reply (or raises
ClientError / TimeoutError). A shell (the sync `Client`, the asyncio
`AsyncClient`) runs a flow to its end by performing each effect on its socket
and resuming the flow with nothing:

    Send(frames, what, to_events)
                        send the frames, on the request socket, or with
                        `to_events` on the events socket. A failure (a send
                        timeout, raised as `core.send_failed(what)`, or a
                        closed client) is thrown into the flow, whose cleanup
                        then runs.
    Wait(deadline, on)  receive frames from both sockets, routing each through
                        `core.router`, until one answers a waiting request or
                        `deadline` passes; returning early is allowed. `on`
                        names what the flow waits for (a ref, a call id,
                        `client_router.LISTENING`; None: anything), so a shell
                        serving many flows wakes only the one concerned.

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
the current operation ends, at the latest on close. A call of `submit` or read with `events()` is never cancelled by the
client: its reader may be one of several, and its caller holds the id.

Deadlines are `time.monotonic()` values, the only clock read here. What to
send, which reply ops are valid, what to raise, when `events()` re-subscribes
or probes and what `stream_text` yields are all decided here and in
`client_base`; the shells hold no protocol logic. An operation added to
`ClientCore` becomes a method of each shell by one line
(`name = _blocking(ClientCore.name)` in client.py, `_awaitable` in client_async.py).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections import deque
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from time import monotonic
from typing import Any, TypeVar

from streamfence.protocol.client_base import (
    Options,
    accepted_call_id,
    call_msg,
    expect_reply,
    finished_ok,
    listen_msg,
    new_ref,
    raw_ref,
    status_msg,
    submit_msg,
    text_piece,
)
from streamfence.protocol.client_router import (
    BAD_REPLY,
    EVENTS_LOST,
    LISTENING,
    ClientError,
    Router,
)
from streamfence.protocol.codec import encode
from streamfence.protocol.messages import Op, events_endpoint

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger("streamfence.client")


@dataclass(slots=True)
class Send:
    frames: list[bytes]
    what: str  # names the request in a send-timeout error
    to_events: bool = False  # on the events socket (`listen`)


@dataclass(slots=True)
class Wait:
    deadline: float
    on: str | None = None  # the key the router marks `woken` for it (None: any message)


Effect = Send | Wait
Flow = Generator[Effect, None, T]
_DONE = Op.DONE.value  # compared per event: a plain str compares faster than the enum member


def shown_as(flow: Callable[..., Any]) -> Callable[[F], F]:
    """Give a shell's method the name, docstring and parameters of the flow it runs
    (not its return annotation: the method returns what the flow returns)."""
    def show(method: F) -> F:
        functools.update_wrapper(method, flow)
        setattr(method, "__signature__",  # noqa: B010 (mypy knows no such attribute)
                inspect.signature(flow).replace(return_annotation=inspect.Signature.empty))
        return method
    return show


class ClientCore:
    """Settings, the Router, and the flow of every client operation."""

    def __init__(self, endpoint: str, timeout_s: float, max_frame: int) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self.endpoint = endpoint
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

    def _no_reply(self, what: str, ref: str | None, timeout_s: float) -> TimeoutError:
        ref_text = f"ref {ref}" if ref is not None else "no ref"
        return TimeoutError(f"no reply to {what} ({ref_text}) from {self.endpoint} "
                            f"within {timeout_s:g} s")

    def _listen(self) -> Flow[None]:
        """Make sure the events connection is up (until the first `listening`;
        tasks of an AsyncClient that ask at once may each say `listen`)."""
        if self.router.listening:
            return
        self.router.listen_sent()
        yield Send([encode(listen_msg())], "listen", to_events=True)
        deadline = monotonic() + self.timeout_s
        while not self.router.listening:
            if monotonic() >= deadline:
                raise TimeoutError(f"no answer to listen from the events endpoint "
                                   f"{self.events_endpoint} within {self.timeout_s:g} s")
            yield Wait(deadline, LISTENING)

    def _exchange(self, msg: dict[str, Any], what: str, timeout_s: float) -> Flow[dict[str, Any]]:
        """Send `msg` and return the reply that echoes its ref."""
        ref: str = msg["ref"]
        self.router.expect(ref)
        try:
            yield Send([encode(msg)], what)
            deadline = monotonic() + timeout_s
            while (reply := self.router.take_reply(ref)) is None:
                if monotonic() >= deadline:
                    raise self._no_reply(what, ref, timeout_s)
                yield Wait(deadline, ref)
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
            deadline = monotonic() + timeout
            while (reply := self.router.take_unattributed()) is None:
                if monotonic() >= deadline:
                    raise self._no_reply("a raw message", None, timeout)
                yield Wait(deadline)
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
            if self.router.is_finished(call_id):
                # A duplicate of a call read to its done already: its replay may have
                # come (on the other socket) before `accepted`, and was dropped.
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
        ref) if it had already ended."""
        what = f"cancel of call {call_id}"
        reply = yield from self._exchange(call_msg(Op.CANCEL, new_ref(), call_id), what,
                                          self.timeout_s)
        return expect_reply(reply, (Op.CANCELLING, Op.DONE), what)

    def status(self) -> Flow[dict[str, Any]]:
        """The daemon's `status_reply`: workers, calls, breakers, counters."""
        reply = yield from self._exchange(status_msg(new_ref()), "status", self.timeout_s)
        return expect_reply(reply, (Op.STATUS_REPLY,), "status")

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


class EventReader:
    """One `events()` iteration: hands out the call's events, decides when to wait,
    re-subscribe, probe or give up.

    A shell iterates with `take()` (a buffered event, no I/O) and, when that
    finds none, runs the `wait()` flow. `limit` (the caller's timeout_s) is
    the longest silence allowed between two events; None means no limit while
    the daemon answers. A gap (a later event came, the next one did not) is
    refilled by a subscribe from the last seq handed out. After the client's
    timeout_s without an event it probes: it re-subscribes from the last seq
    (which repairs a subscription lost to a reconnect or a daemon restart)
    and asks `result` with wait_s 0, whose missing answer raises TimeoutError.
    A probe that finds the call done hands that done event to the stream; if
    the events before it still have not come by the next probe, EVENTS_LOST
    is raised. When the events connection was made again (the router counts
    reconnects), it re-subscribes from the last seq at once.
    """

    def __init__(self, core: ClientCore, call_id: str, limit: float | None) -> None:
        self._core, self._router = core, core.router
        self._next_event = core.router.next_event  # bound once: take() runs per event
        self.call_id = call_id
        self.limit = limit
        self.last_event = self.quiet_since = monotonic()
        self.done_probes = 0  # probes in a row that found the call done
        self.reconnects = core.router.reconnects  # the router's count, as last acted on
        self.ended = False  # its done was handed out, or it had ended before
        self._wait = Wait(0.0, call_id)  # reused: the wait path allocates no effect per event

    def take(self) -> dict[str, Any] | None:
        """The call's next event if it is buffered; None otherwise or after its done."""
        if self.ended:
            return None
        event = self._next_event(self.call_id)
        if event is not None:
            self.last_event = self.quiet_since = monotonic()
            self.done_probes = 0
            self.ended = event["op"] == _DONE
        return event

    def wait(self) -> Flow[dict[str, Any] | None]:
        """After take() found nothing: the call's next event, waiting for it (and
        re-subscribing or probing when due); None once its events have ended."""
        router, call_id, wait = self._router, self.call_id, self._wait
        while not self.ended:
            if router.is_finished(call_id):
                self.ended = True
                break
            gap_from = router.gap(call_id)
            if router.take_cut(call_id):
                gap_from = router.last_seq(call_id)
            if router.reconnects != self.reconnects:
                self.reconnects = router.reconnects
                gap_from = router.last_seq(call_id)
            if gap_from is not None:
                yield from self._core.subscribe(call_id, gap_from)
            if self._probe_due(monotonic()):
                yield from self._probe()
            else:
                probe_at = self.quiet_since + self._core.timeout_s
                wait.deadline = (probe_at if self.limit is None
                                 else min(probe_at, self.last_event + self.limit))
                yield wait
            event = self.take()
            if event is not None:
                return event
        return None

    def _probe_due(self, now: float) -> bool:
        """True if a probe is due; raises TimeoutError past the caller's limit."""
        if self.limit is not None and now - self.last_event >= self.limit:
            raise TimeoutError(f"no event for call {self.call_id} within {self.limit:g} s "
                               f"(last seq received: {self._router.last_seq(self.call_id)})")
        return now - self.quiet_since >= self._core.timeout_s

    def _probe(self) -> Flow[None]:
        core, router, call_id = self._core, self._router, self.call_id
        yield from core.subscribe(call_id, router.last_seq(call_id))
        try:
            reply = yield from core.result(call_id)
        except TimeoutError as exc:
            raise TimeoutError(f"waiting for events of call {call_id} (last seq received: "
                               f"{router.last_seq(call_id)}), the daemon did not answer a "
                               f"liveness probe: {exc}") from None
        self.quiet_since = monotonic()
        if reply is None:
            return
        self.done_probes += 1
        if self.done_probes > 1:
            raise ClientError(EVENTS_LOST, f"call {call_id} is done (done seq "
                              f"{reply.get('seq')}) but its events after seq "
                              f"{router.last_seq(call_id)} did not arrive after re-subscribing",
                              reply)
        # The done event as stored: without the reply's ref and diagnostics.
        router.deliver({k: v for k, v in reply.items() if k not in ("ref", "diagnostics")})


class TextFlow:
    """The state of one `stream_text`: submits on the first piece, then reads the text.

    `call_id` is set once the call was accepted, `done` once its done event
    came. A call that ends `failed` or `cancelled` raises CallFailed after its
    text; after the end, an exception or `close()`, every further piece is
    None (the end). Closed (or left by an exception) before its done, the
    call is cancelled unless `detach` (module docstring).
    """

    def __init__(self, core: ClientCore, provider: str, request: Mapping[str, Any],
                 markers: bool, timeout_s: float | None, detach: bool,
                 submit_kw: dict[str, Any]) -> None:
        self.call_id: str | None = None
        self.done: dict[str, Any] | None = None
        self.detach = detach
        self._core, self._provider, self._request = core, provider, request
        self._markers, self._timeout_s, self._submit_kw = markers, timeout_s, submit_kw
        self._events: EventReader | None = None
        self._over = False
        self._left = False  # `close` left the accepted call (once)

    def close(self) -> None:
        """No more pieces; an accepted call without its done is left (`ClientCore.leave`:
        cancelled unless detached). Idempotent, no I/O: the shell sends the cancel."""
        self._over = True
        if self.call_id is not None and self.done is None and not self._left:
            self._left = True
            self._core.leave(self.call_id)

    def next_piece(self) -> Flow[str | None]:
        """The next piece of text (see client_base.text_piece); None at the end."""
        if self._over:
            return None
        try:
            if self._events is None:
                call_id = yield from self._core.submit(
                    self._provider, self._request, subscribe=True, **self._submit_kw)
                self.call_id = call_id
                if not self.detach:
                    self._core.owned.add(call_id)
                if self._over:  # closed (by another task) while the submit was out
                    self.close()
                    return None
                self._events = self._core.events(call_id, self._timeout_s)
            events = self._events
            while (event := events.take() or (yield from events.wait())) is not None:
                if event["op"] == Op.DONE:
                    self._over = True
                    self.done = dict(event)
                    self._core.owned.discard(events.call_id)
                    finished_ok(event)
                    return None
                piece = text_piece(event, self._markers)
                if piece:
                    return piece
            self._over = True
            return None
        except BaseException:
            self.close()
            raise


class ClientBase:
    """What both shells share besides their transport: the core and its settings."""

    def __init__(self, endpoint: str, timeout_s: float, max_frame: int) -> None:
        self._core = ClientCore(endpoint, timeout_s, max_frame)
        self._closed = False

    @property
    def endpoint(self) -> str:
        return self._core.endpoint

    @property
    def timeout_s(self) -> float:
        return self._core.timeout_s

    def last_seq(self, call_id: str) -> int:
        """Highest seq of `call_id` handed out by events(); 0 if none.

        A program that reconnects (or restarts, having stored it) resumes
        with `subscribe(call_id, from_seq=last_seq)`: the next event is seq+1.
        """
        return self._core.router.last_seq(call_id)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the client of {self.endpoint} is closed")
