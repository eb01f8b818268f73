"""The supervisor's end of the sink's control socket.

A `status` asks the sink for its counters; a sink that does not answer
within STATS_WAIT_S (stopped, or stuck) does not hold the reply: it goes
with the last counters known, marked so (`read_stats`, `expire`).

Replies and attempt endings share one socket, so their order is the sink's
order: an attempt's E_ENDED that the sink produced before a fence arrives
before that fence's reply. The attempt driver relies on this. The calls'
events do not come here: the sink sends them to the subscribers itself.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol, TypeVar

import msgpack
import zmq

from streamfence.protocol.internal.checks import BadFrame
from streamfence.protocol.internal.control import (
    AddSubscriber,
    Adopt,
    AttemptStats,
    Authorize,
    ControlOp,
    Ended,
    Fence,
    FinalRefused,
    Finish,
    FinishMeta,
    Follow,
    FollowedDone,
    ListenerOwner,
    Lost,
    Rebind,
    Reply,
    Stats,
    encode_control,
    parse_from_sink,
    stats_from_wire,
)
from streamfence.protocol.internal.outcome import BadOutcome
from streamfence.protocol.messages import CallStatus
from streamfence.supervisor.timers import Deadlines

log = logging.getLogger("streamfence.sinklink")


@dataclass(frozen=True, slots=True)
class Refused:
    """The sink refused a request (R_REFUSED)."""

    reason: str


class SinkLost(Enum):
    """The sink died before answering (a restarted sink never will)."""

    SINK_LOST = "the sink died before answering"


SINK_LOST = SinkLost.SINK_LOST
# How long a `status` waits for the sink's counters (it answers in
# milliseconds when it runs; the clients' default timeout is 10 s).
STATS_WAIT_S = 1.0
# What a stats request's callback gets: the counters, and whether the sink
# sent them for this request (False: the last ones known).
StatsCallback = Callable[[dict[str, Any], bool], None]
T = TypeVar("T")
# What a request's callback gets: the parsed payload, or why there is none.
StatsReply = AttemptStats | Refused | SinkLost
DoneReply = dict[str, Any] | Refused | SinkLost


@dataclass(frozen=True, slots=True)
class Finished:
    """A finish's answer: the done event, and the deltas the fence refused of
    each attempt (attempt -> count; empty when the done was stored before)."""

    done: dict[str, Any]
    refused: dict[int, int]


FinishReply = Finished | Refused | SinkLost


def why(reply: Refused | SinkLost) -> str:
    return reply.reason if isinstance(reply, Refused) else reply.value


class AttemptEvents(Protocol):
    """Who hears of attempts ending at the sink (the AttemptDriver)."""

    def on_ended(self, ended: Ended) -> None: ...

    def on_final_refused(self, refused: FinalRefused) -> None: ...

    def on_lost(self, lost: Lost) -> None: ...

    def on_followed_done(self, done: FollowedDone) -> None: ...


class SinkLink:
    """Owns the supervisor's end of `sink.ctl`: request ids, the callbacks of
    requests in flight, and the sink's last counters (for `status` when the
    sink is gone or late: their waits are its deadlines, `next_due` and
    `expire`). Attempt endings go to the AttemptEvents given to `drain`."""

    def __init__(self, socket: zmq.Socket[bytes], clock: Callable[[], float]) -> None:
        self.socket = socket
        self._clock = clock
        self._next_req = 1
        self._pending: dict[int, Callable[[Reply | SinkLost], None]] = {}
        self.stats: dict[str, Any] = {}
        self._stats_due: Deadlines[int] = Deadlines()  # stats request -> when it answers late
        self._late: dict[int, Callable[[], None]] = {}

    def _request(self, op: Callable[[int], ControlOp], parse: Callable[[Any], T],
                 reply: Callable[[T | Refused | SinkLost], None]) -> int:
        req = self._next_req
        self._next_req += 1

        def deliver(r: Reply | SinkLost) -> None:
            if isinstance(r, SinkLost):
                reply(r)
            else:
                reply(parse(r.payload) if r.ok else Refused(str(r.payload)))

        self._pending[req] = deliver
        self.socket.send(encode_control(op(req)))
        return req

    def authorize(self, call_id: str, attempt: int, reset: bool, model: str,
                  reply: Callable[[StatsReply], None]) -> None:
        """The reply carries the stats of the attempt that was current before
        (in cluster mode, once the sink opened the attempt's epoch in the call's log)."""
        self._request(lambda req: Authorize(req, call_id, attempt, reset, model),
                      stats_from_wire, reply)

    def fence(self, call_id: str, attempt: int, reply: Callable[[StatsReply], None]) -> None:
        """The reply carries the fenced attempt's stats."""
        self._request(lambda req: Fence(req, call_id, attempt), stats_from_wire, reply)

    def rebind(self, call_id: str, attempt: int, from_attempt: int, content_from: int,
               token: int, reply: Callable[[StatsReply], None]) -> None:
        """The reply carries the stats of the answer so far (`last_seq`: where
        the worker resumes)."""
        self._request(lambda req: Rebind(req, call_id, attempt, from_attempt, content_from,
                                         token), stats_from_wire, reply)

    def adopt(self, call_id: str, epoch: int, reply: Callable[[StatsReply], None]) -> None:
        """Cluster mode: a call taken over at `epoch`; the reply carries the stats
        of the content its log held (ARCHITECTURE §4.17)."""
        self._request(lambda req: Adopt(req, call_id, epoch), stats_from_wire, reply)

    def finish(self, call_id: str, status: CallStatus, error: dict[str, Any] | None,
               attempts: int, meta: FinishMeta, reply: Callable[[FinishReply], None]) -> None:
        """The reply carries the done event (the same one again if repeated)."""
        self._request(lambda req: Finish(req, call_id, status, error, attempts, meta),
                      _finished, reply)

    def subscribe(self, call_id: str, listener: str, from_seq: int, live: bool,
                  owner: ListenerOwner, reply: Callable[[Refused | SinkLost | None], None]
                  ) -> None:
        """`listener` gets the call's events after `from_seq` (FROM_NOW: only new
        ones) from the sink; `live`: the call has not ended; `owner`: the
        identity it is charged to (its caps)."""
        self._request(lambda req: AddSubscriber(req, call_id, listener, from_seq, live, owner),
                      lambda _: None, reply)

    def follow(self, call_id: str, reply: Callable[[dict[str, Any] | Refused | SinkLost], None]
               ) -> None:
        """Cluster mode: store and follow a call another host runs; the reply
        says whether it is done (ARCHITECTURE §4.17, rule 5)."""
        self._request(lambda req: Follow(req, call_id), _as_map, reply)

    def read_stats(self, reply: StatsCallback, wait_s: float | None = None) -> None:
        """Ask the sink for its counters; `reply` gets them once: the sink's
        answer, or the last ones known if the sink died first or, given
        `wait_s`, has not answered within it (a late answer is still kept)."""
        replied = False

        def answer(fresh: bool) -> None:
            nonlocal replied
            if not replied:
                replied = True
                reply(self.stats, fresh)

        def store(r: DoneReply) -> None:
            if isinstance(r, dict):
                self.stats = r
            self._late.pop(req, None)
            self._stats_due.clear(req)
            answer(isinstance(r, dict))

        req = self._request(Stats, _as_map, store)
        if wait_s is not None:
            self._late[req] = functools.partial(answer, False)
            self._stats_due.arm(req, self._clock() + wait_s)

    def next_due(self) -> float | None:
        """When the next stats request stops waiting for the sink."""
        return self._stats_due.next_due()

    def expire(self, now: float) -> None:
        """Stats requests the sink left unanswered too long get the last counters."""
        for req in self._stats_due.pop_due(now):
            late = self._late.pop(req, None)
            if late is not None:
                late()

    def fail_pending(self) -> None:
        """The sink died: its replies will never come. Each waiting callback gets
        SINK_LOST (in request order)."""
        lost = list(self._pending.values())
        self._pending.clear()
        for deliver in lost:
            deliver(SINK_LOST)

    def drain(self, attempts: AttemptEvents, limit: int = 10_000) -> int:
        """Handle what the sink sent, without blocking. Returns messages handled."""
        n = 0
        while n < limit:
            try:
                frame = self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            n += 1
            try:
                msg = parse_from_sink(msgpack.unpackb(frame, raw=False))
            except (BadFrame, BadOutcome) as exc:
                log.warning("bad message from the sink: %s", exc)
                continue
            if isinstance(msg, Reply):
                deliver = self._pending.pop(msg.req, None)
                if deliver is None:
                    log.warning("sink reply to unknown request %r", msg.req)
                else:
                    deliver(msg)
            elif isinstance(msg, Ended):
                attempts.on_ended(msg)
            elif isinstance(msg, FinalRefused):
                attempts.on_final_refused(msg)
            elif isinstance(msg, Lost):
                attempts.on_lost(msg)
            elif isinstance(msg, FollowedDone):
                attempts.on_followed_done(msg)
        return n


def _as_map(payload: Any) -> dict[str, Any]:
    return payload if isinstance(payload, dict) else {}


def _finished(payload: Any) -> Finished:
    """FINISH's payload: [the done, [[attempt, refused], ...]]."""
    done, pairs = payload
    return Finished(_as_map(done), {int(attempt): int(n) for attempt, n in pairs})
