"""The I/O-free parts the two client flavours share, besides routing.

Request builders (validated with the daemon's own `parse_request` before they
are sent), `ClientBase` (settings and helpers of Client and AsyncClient),
`EventWatch` (when `events()` gives up or probes the daemon) and the
`stream_text` iterators. Nothing here touches a socket or reads a clock.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from streamfence.protocol.client_router import (
    BAD_REPLY,
    EVENTS_LOST,
    CallFailed,
    ClientError,
    Router,
)
from streamfence.protocol.errors import ProtocolError
from streamfence.protocol.messages import MAX_REF_LEN, VERSION, CallOptions, Op, parse_request

DEFAULT_ENDPOINT = "tcp://127.0.0.1:7755"
Options = Mapping[str, Any] | CallOptions


def new_ref() -> str:
    return uuid.uuid4().hex


def expect_reply(reply: dict[str, Any], ops: tuple[Op, ...], what: str) -> dict[str, Any]:
    """Return `reply` if its op is one of `ops`; raise ClientError otherwise."""
    op = reply.get("op")
    if op == Op.ERROR:
        raise ClientError(str(reply.get("code")), str(reply.get("message")), reply)
    if op not in ops:
        raise ClientError(BAD_REPLY, f"unexpected reply op {op!r} to {what}", reply)
    return reply


def checked(msg: dict[str, Any]) -> dict[str, Any]:
    """Validate an outgoing request with the daemon's own parser: fail here, not there."""
    try:
        parse_request(msg)
    except ProtocolError as exc:
        raise ClientError(exc.code.value, exc.message) from None
    return msg


def submit_msg(ref: str, provider: str, request: Mapping[str, Any], *, session_id: str | None,
               idempotency_key: str | None, options: Mapping[str, Any] | CallOptions | None,
               subscribe: bool) -> dict[str, Any]:
    call: dict[str, Any] = {"provider": provider, "request": dict(request)}
    if session_id is not None:
        call["session_id"] = session_id
    if idempotency_key is not None:
        call["idempotency_key"] = idempotency_key
    if options is not None:
        opts = options.to_map() if isinstance(options, CallOptions) else dict(options)
        call["options"] = {k: v for k, v in opts.items() if v is not None}
    return checked({"v": VERSION, "op": Op.SUBMIT.value, "ref": ref, "call": call,
                    "subscribe": subscribe})


def call_msg(op: Op, ref: str, call_id: str, **extra: Any) -> dict[str, Any]:
    """subscribe / result / cancel: the ops that name a call."""
    return checked({"v": VERSION, "op": op.value, "ref": ref, "call_id": call_id, **extra})


def status_msg(ref: str) -> dict[str, Any]:
    return checked({"v": VERSION, "op": Op.STATUS.value, "ref": ref})


# ---- the client classes' I/O-free base ------------------------------------

def raw_ref(msg: Mapping[str, Any]) -> str | None:
    """The ref the daemon will echo for `msg`, or None if it cannot echo one."""
    ref = msg.get("ref")
    return ref if isinstance(ref, str) and len(ref) <= MAX_REF_LEN else None


class ClientBase:
    """What both flavours share: settings, the router, the non-I/O helpers."""

    def __init__(self, endpoint: str, timeout_s: float, max_frame: int) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self.endpoint = endpoint
        self.timeout_s = float(timeout_s)
        self._router = Router(max_frame)
        self._closed = False

    def last_seq(self, call_id: str) -> int:
        """Highest seq of `call_id` handed out by events(); 0 if none.

        A program that reconnects (or restarts, having stored it) resumes
        with `subscribe(call_id, from_seq=last_seq)`: the next event is seq+1.
        """
        return self._router.last_seq(call_id)

    def _timeout(self, timeout_s: float | None) -> float:
        return self.timeout_s if timeout_s is None else timeout_s

    def _no_reply(self, what: str, ref: str | None, timeout_s: float) -> TimeoutError:
        ref_text = f"ref {ref}" if ref is not None else "no ref"
        return TimeoutError(f"no reply to {what} ({ref_text}) from {self.endpoint} "
                            f"within {timeout_s:g} s")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the client of {self.endpoint} is closed")


# ---- stream_text -------------------------------------------------------------

def text_piece(event: Mapping[str, Any], markers: bool) -> str | None:
    """What `stream_text` yields for one event: text deltas, and with `markers`
    a bracketed line for a reset or a notice; None for everything else."""
    op = event.get("op")
    if op == Op.DELTA:
        kind, data = event.get("kind"), event.get("data")
        if kind == "text" and isinstance(data, str):
            return data
        if markers and kind == "notice":
            text = data.get("message", data) if isinstance(data, dict) else data
            return f"\n[notice: {text}]\n"
    elif op == Op.RESET and markers:
        return f"\n[reset: the text above is void; attempt {event.get('attempt')} follows]\n"
    return None


def finished_ok(done: Mapping[str, Any]) -> dict[str, Any]:
    """The done event if the call ended completed or partial; CallFailed otherwise."""
    if done.get("status") not in ("completed", "partial"):
        raise CallFailed(done)
    return dict(done)


class TextStream:
    """Iterator over the text of one call; submits on the first `next()`.

    After the iteration, `done` holds the call's done event; `call_id` is set
    once the call was accepted. A call that ends `failed` or `cancelled`
    raises CallFailed at the end of the iteration (after its text).
    """

    def __init__(self, submit: Callable[[], str],
                 events: Callable[[str], Iterator[dict[str, Any]]], markers: bool) -> None:
        self.call_id: str | None = None
        self.done: dict[str, Any] | None = None
        self._gen = self._run(submit, events, markers)

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> str:
        return next(self._gen)

    def _run(self, submit: Callable[[], str],
             events: Callable[[str], Iterator[dict[str, Any]]], markers: bool) -> Iterator[str]:
        self.call_id = submit()
        for event in events(self.call_id):
            if event.get("op") == Op.DONE:
                self.done = dict(event)
                finished_ok(event)
                return
            piece = text_piece(event, markers)
            if piece:
                yield piece


class AsyncTextStream:
    """The asyncio twin of TextStream (`async for`)."""

    def __init__(self, submit: Callable[[], Awaitable[str]],
                 events: Callable[[str], AsyncIterator[dict[str, Any]]], markers: bool) -> None:
        self.call_id: str | None = None
        self.done: dict[str, Any] | None = None
        self._gen = self._run(submit, events, markers)

    def __aiter__(self) -> AsyncTextStream:
        return self

    async def __anext__(self) -> str:
        return await self._gen.__anext__()

    async def _run(self, submit: Callable[[], Awaitable[str]],
                   events: Callable[[str], AsyncIterator[dict[str, Any]]],
                   markers: bool) -> AsyncIterator[str]:
        self.call_id = await submit()
        async for event in events(self.call_id):
            if event.get("op") == Op.DONE:
                self.done = dict(event)
                finished_ok(event)
                return
            piece = text_piece(event, markers)
            if piece:
                yield piece


# ---- the waiting policy of events() -----------------------------------------

@dataclass
class EventWatch:
    """When `events()` gives up, and when it checks on the daemon (pure: time is passed in).

    `limit` (the caller's timeout_s) is the longest silence allowed between two
    events; None means no limit while the daemon answers. After `probe_every`
    seconds without an event (the client's request timeout), the client
    probes: it re-subscribes from the last seq it handed out (which repairs a
    subscription lost to a reconnect or a daemon restart) and asks `result`
    with wait_s 0, whose missing answer raises TimeoutError. A probe that
    finds the call done hands that done event to the stream; if the events
    before it still have not come by the next probe, EVENTS_LOST is raised.
    """

    call_id: str
    limit: float | None
    probe_every: float
    last_event: float
    quiet_since: float
    done_probes: int = 0

    def on_event(self, now: float) -> None:
        self.last_event = self.quiet_since = now
        self.done_probes = 0

    def due(self, now: float, last_seq: int) -> bool:
        """True if a probe is due; raises TimeoutError past the caller's limit."""
        if self.limit is not None and now - self.last_event >= self.limit:
            raise TimeoutError(f"no event for call {self.call_id} within {self.limit:g} s "
                               f"(last seq received: {last_seq})")
        return now - self.quiet_since >= self.probe_every

    def deadline(self) -> float:
        probe_at = self.quiet_since + self.probe_every
        return probe_at if self.limit is None else min(probe_at, self.last_event + self.limit)

    def probe_failed(self, exc: TimeoutError, last_seq: int) -> TimeoutError:
        return TimeoutError(f"waiting for events of call {self.call_id} (last seq received: "
                            f"{last_seq}), the daemon did not answer a liveness probe: {exc}")

    def probed(self, now: float, reply: dict[str, Any] | None, last_seq: int) -> dict[str, Any] | None:
        """Account for a probe's `result` answer; return a done event to deliver, if any."""
        self.quiet_since = now
        if reply is None:
            return None
        self.done_probes += 1
        if self.done_probes > 1:
            raise ClientError(EVENTS_LOST, f"call {self.call_id} is done (done seq "
                              f"{reply.get('seq')}) but its events after seq {last_seq} did not "
                              "arrive after re-subscribing", reply)
        return {k: v for k, v in reply.items() if k != "ref"}

