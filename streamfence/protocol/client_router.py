"""The I/O-free heart of the client library: routing what the daemon sends.

`streamfence.protocol.client` and `streamfence.protocol.client_async` own the sockets; `Router` here
takes every frame the daemon sends and puts it where a caller will look for
it, without a socket, so it is shared by both flavours and testable alone:

- a message with a string `ref` is a reply. It is kept for the request that
  is waiting for that ref; a reply whose request gave up (timed out) is
  discarded. An `error` answering a `subscribe`, or one with `ref: nil` and a
  `call_id` (a replay that failed), is kept on that call's stream, so
  `events()` raises it.
- any other `error` with `ref: nil` is an answer the daemon could not attribute (it
  could not read the request: `bad_frame`, `too_large`, a missing or invalid
  ref). It goes to a raw request waiting for exactly that, or else to the only
  request outstanding, or is logged and discarded.
- `listening` is the events socket's answer to `listen`: the client's
  events connection is up (`listening` becomes True; `link_offer`: the
  sink's offer of a local link, client_local.py). The shell reports
  each handshake of that connection (`handshake`); one after the first is a
  reconnect (the daemon or its sink restarted, or the network blinked), and
  readers subscribe again from their last seq at once instead of at their
  next probe. `listen` is said once per connection (`listen_due`): again
  after a reconnect, even to a flow still waiting for the answer to the one
  before (a sink that died before it answered never will).
- `cut_off`: the events socket stopped sending a call to this client after
  the seq it names (the client fell a window behind, PROTOCOL §5); the
  call's reader subscribes again from its last seq, once, when it has
  handed out what it holds. The shell counts the bytes it reads on the
  events socket (`read_events`) and says `ack` with the total now and then
  (`ack_due`), which is what lets the daemon send more.
- `delta`, `reset` and `done` without a ref are pushed events; an array
  of them (one commit's events for this client) is routed element by
  element. They are buffered per call in a heap keyed by `seq` until the
  caller asks for them, whether or not anyone reads that call yet; an event already seen
  (seq at or below the last one handed out, or already buffered) is a
  duplicate from a replay and is discarded. A call the caller stopped
  reading (`stop_reading`: an abandoned `stream_text` or `run`) is treated
  as a finished one: its buffer is freed and its later events discarded.
- the reply to the cancel of an abandoned call (`cancel_sent`) is awaited by
  nobody: discarded; until it comes the call counts as `cancels_unanswered`.
`woken` collects what the routing was for since the shell last emptied it
(refs, calls, `LISTENING`, `ANY`); the asyncio shell wakes only those.

Nothing here blocks or reads a clock (the shell passes the time to `ack_due`).
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from streamfence.protocol.codec import DEFAULT_MAX_FRAME, decode_untrusted, encode
from streamfence.protocol.errors import ProtocolError
from streamfence.protocol.messages import VERSION, Op

log = logging.getLogger("streamfence.client")

BAD_REPLY = "bad_reply"  # client-side code: the daemon broke the protocol
EVENTS_LOST = "events_lost"  # client-side code: the call ended but its events never came
_EVENT_OPS = frozenset({Op.DELTA.value, Op.RESET.value, Op.DONE.value})
_KEEP_FINISHED = 4096  # finished calls remembered to discard late duplicates
_KEEP_SUBSCRIBE_REFS = 1024  # a subscribe's success has no reply: keep the latest refs only
_KEEP_CANCEL_REFS = 1024  # cancels of abandoned calls awaiting their (discarded) reply
ACK_EVERY = 64 << 10  # say `ack` after this many bytes read on the events socket ...
ACK_AFTER_S = 2.0  # ... or this long after the last, if anything was read (an ack wakes the sink)
LISTENING, ANY = " listening", " any"  # keys of `Router.woken` besides refs and call ids


class ClientError(Exception):
    """The daemon answered with an `error` (or broke the protocol).

    `code` is the wire code (see streamfence.protocol.errors.ErrorCode; a newer daemon may
    send codes this client does not know, so it is kept as a str). Two codes
    are raised by the client itself: `bad_reply` (the daemon sent something
    the protocol does not allow) and `events_lost` (the daemon reports the
    call done but the events before its `done` never arrived).
    """

    def __init__(self, code: str, message: str, reply: Mapping[str, Any] | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.reply = dict(reply) if reply is not None else None


class CallFailed(ClientError):
    """A call ended `failed` or `cancelled` (raised by `stream_text`).

    `done` is the call's `done` event; `code`/`message` come from its `error`.
    """

    def __init__(self, done: Mapping[str, Any]) -> None:
        err = done.get("error")
        code = str(err.get("code", "")) if isinstance(err, dict) else ""
        message = str(err.get("message", "")) if isinstance(err, dict) else ""
        status = done.get("status")
        super().__init__(code or str(status), f"call {done.get('call_id')} ended {status}: "
                         f"{message or 'no error message'}", done)
        self.done = dict(done)


@dataclass
class CallStream:
    """The pushed events of one call, in seq order, each handed out once."""

    call_id: str
    last: int = 0  # highest seq handed to the caller (or skipped by from_seq)
    heap: list[tuple[int, int, dict[str, Any]]] = field(default_factory=list)
    buffered: set[int] = field(default_factory=set)
    error: ClientError | None = None  # the error reply to a subscribe of this call
    finished: bool = False  # its done event was handed out
    refill_for: int = -1  # `last` at which a refilling subscribe was already sent
    cut: bool = False  # the events socket cut this call off: subscribe again

    def push(self, seq: int, event: dict[str, Any], order: int) -> None:
        if self.finished or seq <= self.last or seq in self.buffered:
            log.debug("duplicate event seq %d of call %s discarded", seq, self.call_id)
            return
        self.buffered.add(seq)
        heapq.heappush(self.heap, (seq, order, event))

    def pop(self) -> dict[str, Any] | None:
        if not self.heap or self.heap[0][0] != self.last + 1:
            return None
        seq, _, event = heapq.heappop(self.heap)
        self.buffered.discard(seq)
        self.last = seq
        if event.get("op") == Op.DONE:
            self.finished = True
            self.heap.clear()
            self.buffered.clear()
        return event

    def skip_to(self, seq: int) -> None:
        """The caller starts after `seq` (subscribe from_seq): drop what precedes it."""
        if seq <= self.last:
            return
        self.last = seq
        while self.heap and self.heap[0][0] <= seq:
            self.buffered.discard(heapq.heappop(self.heap)[0])

    def rewind(self, seq: int) -> None:
        """The caller reads again after `seq` (a replay comes): the events handed
        out after it are taken again; the buffered ones stay."""
        self.last, self.refill_for = seq, -1

    def gap(self) -> int | None:
        """`from_seq` to ask again if a later event came but the next one did not.

        Returned once per position, so a persistent gap costs one subscribe.
        """
        if self.heap and self.heap[0][0] > self.last + 1 and self.refill_for != self.last:
            self.refill_for = self.last
            return self.last
        return None


class Router:
    """Routes decoded frames to waiting requests and per-call event buffers."""

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._replies: dict[str, dict[str, Any] | None] = {}  # ref -> reply (None: waiting)
        self._raw_waiters = 0
        self._unattributed: deque[dict[str, Any]] = deque(maxlen=64)
        self._subscribe_refs: OrderedDict[str, str] = OrderedDict()  # subscribe ref -> call_id
        self._cancel_refs: OrderedDict[str, str] = OrderedDict()  # abandoned: ref -> call_id
        self._streams: dict[str, CallStream] = {}
        self._finished: OrderedDict[str, int] = OrderedDict()  # call_id -> seq of its done
        self._order = itertools.count()
        self.listening = False  # the events socket answered `listen`
        self.link_offer: Any = None  # in the last `listening` (unchecked: client_local)
        self.handshakes = 0  # of the events connection (reported by the shell)
        self.reconnects = 0  # handshakes after the first
        self._listened_at = -1  # `reconnects` when `listen` was last sent (-1: never)
        self.read = 0  # bytes read on the events socket since `listen` was sent
        self._acked = 0  # the `read` figure last sent in an `ack`
        self._acked_at = 0.0
        self.woken: set[str] = set()  # module docstring; emptied by the shell

    # ---- requests ---------------------------------------------------------

    def expect(self, ref: str) -> None:
        self._replies[ref] = None

    def forget(self, ref: str) -> None:
        """The request gave up: a late reply with this ref will be discarded."""
        self._replies.pop(ref, None)

    def take_reply(self, ref: str) -> dict[str, Any] | None:
        reply = self._replies.get(ref)
        if reply is not None:
            del self._replies[ref]
        return reply

    def cancel_sent(self, ref: str, call_id: str) -> None:
        """The cancel of an abandoned call went out: nobody waits for its reply."""
        self._cancel_refs[ref] = call_id
        while len(self._cancel_refs) > _KEEP_CANCEL_REFS:
            self._cancel_refs.popitem(last=False)

    @property
    def cancels_unanswered(self) -> int:
        return len(self._cancel_refs)

    def expect_raw(self) -> None:
        self._raw_waiters += 1

    def forget_raw(self) -> None:
        self._raw_waiters = max(0, self._raw_waiters - 1)

    def take_unattributed(self) -> dict[str, Any] | None:
        if not self._unattributed:
            return None
        self._raw_waiters = max(0, self._raw_waiters - 1)
        return self._unattributed.popleft()

    def handshake(self) -> None:
        """The events connection was made; again, after the first: events may
        have been missed."""
        self.handshakes += 1
        if self.handshakes > 1:
            self.reconnects += 1
            self.listening = False  # a new connection: say `listen` on it again

    def listen_due(self) -> bool:
        """No `listen` was sent since the events connection was last made: one
        sent before is lost with the sink that heard it (or that died before)."""
        return self._listened_at != self.reconnects

    def listen_sent(self) -> None:
        """`listen` went out: the daemon counts this connection's bytes afresh."""
        self.read = self._acked = 0
        self._listened_at = self.reconnects

    def read_events(self, frames: list[bytes]) -> bool:
        """Route a message read on the events socket, counting its bytes."""
        for frame in frames:
            self.read += len(frame)
        return self.route(frames)

    def ack_due(self, now: float) -> bytes | None:
        """The `ack` to send now, if one is due (`ACK_EVERY`, `ACK_AFTER_S`)."""
        newly = self.read - self._acked
        if newly <= 0 or (newly < ACK_EVERY and now - self._acked_at < ACK_AFTER_S):
            return None
        self._acked, self._acked_at = self.read, now
        return encode({"v": VERSION, "op": Op.ACK.value, "read": self.read})

    def take_cut(self, call_id: str) -> bool:
        """True once after the events socket cut `call_id` off."""
        s = self._streams.get(call_id)
        if s is None or not s.cut:
            return False
        s.cut = False
        return True

    def subscribing(self, ref: str, call_id: str, from_seq: int) -> None:
        """A subscribe was sent: its error reply belongs to the call's stream."""
        self._subscribe_refs[ref] = call_id
        while len(self._subscribe_refs) > _KEEP_SUBSCRIBE_REFS:
            self._subscribe_refs.popitem(last=False)
        self.reading(call_id, from_seq)

    def reading(self, call_id: str, from_seq: int) -> None:
        """The caller asked for the call's events after `from_seq` (subscribe, or
        submit with subscribe). A from_seq before the last seq handed out asks
        for a replay, the call live or ended: the call is read afresh from
        there (the daemon sends those events again; what is buffered after
        them stays)."""
        if from_seq < self.last_seq(call_id):
            if self.is_finished(call_id):
                self._streams.pop(call_id, None)
                self._finished.pop(call_id, None)
            else:
                self.stream(call_id).rewind(from_seq)
        self.stream(call_id).skip_to(from_seq)

    def stop_reading(self, call_id: str) -> None:
        """The caller reads no more of the call: free its buffered events and
        discard later ones, as for a finished call (a subscribe from an
        earlier seq reads it afresh, as `reading` says)."""
        s = self.stream(call_id)
        s.finished = True
        s.heap.clear()
        s.buffered.clear()
        self._retire(s)

    # ---- events -----------------------------------------------------------

    def stream(self, call_id: str) -> CallStream:
        s = self._streams.get(call_id)
        if s is None:
            s = CallStream(call_id)
            if call_id in self._finished:
                s.last = self._finished[call_id]
                s.finished = True
            self._streams[call_id] = s
        return s

    def next_event(self, call_id: str) -> dict[str, Any] | None:
        """The call's next event in seq order, or None if it has not arrived.

        Raises the ClientError a subscribe of this call was answered with, once
        no buffered event is left to hand out.
        """
        s = self.stream(call_id)
        event = s.pop()
        if event is None and s.error is not None:
            err, s.error = s.error, None
            raise err
        if s.finished:
            self._retire(s)
        return event

    def gap(self, call_id: str) -> int | None:
        return self.stream(call_id).gap()

    def deliver(self, event: dict[str, Any]) -> None:
        """Put an event obtained otherwise (a probe's `done`) into its call's stream."""
        self._route_event(event)

    def last_seq(self, call_id: str) -> int:
        """Highest seq of `call_id` handed to the caller: pass it as `from_seq` to resume."""
        s = self._streams.get(call_id)
        if s is not None:
            return s.last
        return self._finished.get(call_id, 0)

    def is_finished(self, call_id: str) -> bool:
        s = self._streams.get(call_id)
        return s.finished if s is not None else call_id in self._finished

    def _retire(self, s: CallStream) -> None:
        self._streams.pop(s.call_id, None)
        self._finished[s.call_id] = s.last
        while len(self._finished) > _KEEP_FINISHED:
            self._finished.popitem(last=False)

    # ---- routing ----------------------------------------------------------

    def route(self, frames: list[bytes]) -> bool:
        """Take one message from the daemon; True if it answered a waiting request.

        The caller stops routing there, so the request's caller acts on its
        reply before the messages behind it are routed (a submit's caller
        starts reading the call before its replayed events arrive). Raises
        ClientError(bad_reply) on garbage.
        """
        if len(frames) != 1:
            raise ClientError(BAD_REPLY, f"the daemon sent a message of {len(frames)} frames")
        try:
            msg = decode_untrusted(frames[0], self.max_frame)
        except ProtocolError as exc:
            raise ClientError(BAD_REPLY, f"the daemon sent an undecodable frame: {exc}") from None
        return self.route_message(msg)

    def route_message(self, msg: Any) -> bool:
        """`route`, for a message decoded already (a local link's: client_local.py)."""
        if isinstance(msg, list):
            for event in msg:
                if not isinstance(event, dict) or event.get("ref") is not None \
                        or event.get("op") not in _EVENT_OPS:
                    raise ClientError(BAD_REPLY, "the daemon sent an array that is not all events")
                self._route_event(event)
            return False
        if not isinstance(msg, dict):
            raise ClientError(BAD_REPLY, f"the daemon sent a {type(msg).__name__}, not a map")
        ref = msg.get("ref")
        op = msg.get("op")
        if isinstance(ref, str):
            return self._route_reply(ref, msg)
        if ref is None and op == Op.ERROR:
            if not isinstance(msg.get("call_id"), str):
                return self._route_unattributed(msg)
            self._call_error(msg["call_id"], msg, "replay of")  # PROTOCOL §5
        elif ref is None and op in _EVENT_OPS:
            self._route_event(msg)
        elif ref is None and op == Op.LISTENING:
            self.listening = True
            self.link_offer = msg.get("link")  # a local link (client_local.py), if offered
            self.woken.add(LISTENING)
            return True
        elif ref is None and op == Op.CUT_OFF:
            call_id = msg.get("call_id")
            if isinstance(call_id, str) and not self.is_finished(call_id):
                log.debug("call %s cut off after seq %r: %s", call_id, msg.get("seq"),
                          msg.get("reason"))
                self.stream(call_id).cut = True
                self.woken.add(call_id)
        else:
            log.warning("unexpected message from the daemon discarded: op=%r ref=%r", op, ref)
        return False

    def _route_reply(self, ref: str, msg: dict[str, Any]) -> bool:
        if ref in self._replies:
            self._replies[ref] = msg
            self.woken.add(ref)
            return True
        cancelled = self._cancel_refs.pop(ref, None)
        if cancelled is not None:
            if msg.get("op") == Op.ERROR:
                log.warning("the cancel of abandoned call %s was refused: %s: %s", cancelled,
                            msg.get("code"), msg.get("message"))
            return False
        call_id = self._subscribe_refs.pop(ref, None)
        if call_id is not None:
            if msg.get("op") == Op.ERROR:
                self._call_error(call_id, msg, "subscribe to")
            return False
        log.debug("reply op=%r ref=%s to a request that gave up, discarded", msg.get("op"), ref)
        return False

    def _call_error(self, call_id: str, msg: dict[str, Any], what: str) -> None:
        self.stream(call_id).error = ClientError(
            str(msg.get("code")), f"{what} call {call_id}: {msg.get('message')}", msg)
        self.woken.add(call_id)

    def _route_unattributed(self, msg: dict[str, Any]) -> bool:
        if self._raw_waiters:
            self._unattributed.append(msg)
            self.woken.add(ANY)
            return True
        waiting = [ref for ref, reply in self._replies.items() if reply is None]
        if len(waiting) == 1:
            self._replies[waiting[0]] = msg
            self.woken.add(waiting[0])
            return True
        log.warning("error without ref discarded (%d requests outstanding): %s: %s",
                    len(waiting), msg.get("code"), msg.get("message"))
        return False

    def _route_event(self, msg: dict[str, Any]) -> None:
        call_id, seq = msg.get("call_id"), msg.get("seq")
        if not isinstance(call_id, str) or not isinstance(seq, int) or isinstance(seq, bool):
            log.warning("event without a call_id or an integer seq discarded: op=%r call_id=%r "
                        "seq=%r", msg.get("op"), call_id, seq)
            return
        if call_id not in self._streams and call_id in self._finished:
            log.debug("event seq %d of finished call %s discarded", seq, call_id)
            return
        self.stream(call_id).push(seq, msg, next(self._order))
        self.woken.add(call_id)


