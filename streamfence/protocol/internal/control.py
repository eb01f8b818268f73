"""Supervisor <-> sink messages ("sink.ctl"): records, one builder and one parser each.

Supervisor -> sink, each carrying a request id `req` that its reply echoes
(records `Authorize`, `Fence`, `Rebind`, `Finish`, `Stats`, `AddSubscriber`,
`Adopt`, `Follow`; `encode_control` / `parse_control`, which takes the
decoded array as untrusted and raises only BadFrame):
    [C_AUTHORIZE, req, call_id, attempt, reset: bool, model: str|nil]
        model may be absent
    [C_FENCE, req, call_id, attempt]
    [C_REBIND, req, call_id, attempt, from_attempt, content_from, token]
        after a sink restart: the running attempt `from_attempt` (its worker
        holds `token`) writes on as `attempt`, its answer's content being
        every delta since attempt `content_from` (docs/ARCHITECTURE.md §2.8)
    [C_FINISH, req, call_id, status, error: map|nil, attempts, meta]   meta: FinishMeta map
    [C_STATS, req]
    [C_SUBSCRIBE, req, call_id, listener, from_seq, live: bool, owner]   from_seq -1: from now
    [C_ADOPT, req, call_id, epoch]   cluster mode: the call was taken over from a
        dead host at `epoch`: open it in the call's log and store what the log
        holds (answered with the stats of that content; refused if it holds a done)
    [C_FOLLOW, req, call_id]   cluster mode: a call another host runs, asked for
        here: store its log as a replica and follow it to its done (answered {done})
Sink -> supervisor (`parse_from_sink`, on the supervisor's side: its own sink,
trusted; the events themselves go from the sink to the subscribers'
listeners, never through the supervisor):
    [R_OK, req, payload]   `encode_ok`: AttemptStats for AUTHORIZE, FENCE, REBIND and
                           ADOPT, the done event for FINISH, the counters for STATS,
                           {"done": bool} for FOLLOW, nil for SUBSCRIBE
    [R_REFUSED, req, reason]                        `encode_refused`
    [E_ENDED, call_id, attempt, stats, outcome]     `encode_ended`
    [E_FINAL_REFUSED, call_id, attempt, reason]     `encode_final_refused`
    [E_LOST, call_id, attempt, reason]              `encode_lost`: cluster mode, the
        cluster refused the call's run: another host owns it
    [E_FOLLOWED_DONE, call_id, done]                `encode_followed_done`: cluster
        mode, a followed call's done is stored here
AttemptStats: [attempt, accepted, dropped, visible_chars, tool_fragments,
    last_seq, closed] (`stats_to_wire` / `stats_from_wire`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from streamfence.protocol.internal import (
    C_ADOPT,
    C_AUTHORIZE,
    C_FENCE,
    C_FINISH,
    C_FOLLOW,
    C_REBIND,
    C_STATS,
    C_SUBSCRIBE,
    E_ENDED,
    E_FINAL_REFUSED,
    E_FOLLOWED_DONE,
    E_LOST,
    R_OK,
    R_REFUSED,
)
from streamfence.protocol.internal.checks import BadFrame, check_call_id, check_int
from streamfence.protocol.internal.outcome import (
    AttemptOutcome,
    outcome_from_wire,
    outcome_to_wire,
)
from streamfence.protocol.messages import LISTENER_RE, CallStatus

# ---- supervisor <-> sink ("sink.ctl") ----------------------------------------
# Each message: a record, one builder (`encode_*`) and one parser. The sink
# parses what it is sent as untrusted (`parse_control`: it refuses strangers
# but never crashes on a bad frame); the supervisor trusts its own sink.


@dataclass(frozen=True, slots=True)
class AttemptStats:
    """What the sink accepted of one attempt. Wire: its fields in order."""

    attempt: int
    accepted: int = 0
    dropped: int = 0
    visible_chars: int = 0  # protocol.messages.visible_chars, summed over accepted deltas
    tool_fragments: int = 0
    last_seq: int = 0
    closed: bool = False


def stats_to_wire(s: AttemptStats) -> list[Any]:
    return [s.attempt, s.accepted, s.dropped, s.visible_chars, s.tool_fragments, s.last_seq,
            s.closed]


def stats_from_wire(raw: list[Any]) -> AttemptStats:
    return AttemptStats(*raw)


@dataclass(frozen=True, slots=True)
class FinishMeta:
    """What the `done` response takes from the winning attempt beside its
    content. Wire: a map of these fields (None/absent: the default)."""

    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    model: str | None = None
    provider_response_id: str | None = None
    partial: bool = False
    dropped_tool_names: tuple[str, ...] = ()
    dropped_tool_indexes: tuple[int, ...] = ()


def meta_to_wire(m: FinishMeta) -> dict[str, Any]:
    return {"finish_reason": m.finish_reason, "usage": m.usage, "model": m.model,
            "provider_response_id": m.provider_response_id, "partial": m.partial,
            "dropped_tool_names": list(m.dropped_tool_names),
            "dropped_tool_indexes": list(m.dropped_tool_indexes)}


_META_SCALARS: tuple[tuple[str, type, str], ...] = (
    ("finish_reason", str, "a string"), ("usage", dict, "a map"), ("model", str, "a string"),
    ("provider_response_id", str, "a string"), ("partial", bool, "a boolean"))


def meta_from_wire(raw: Any, req: int | str | None = None) -> FinishMeta:
    """Raises BadFrame naming the field (unknown keys are ignored)."""
    if raw is None:
        return FinishMeta()
    if type(raw) is not dict:
        raise BadFrame("meta must be a map or nil", req)
    for key, kind, what in _META_SCALARS:
        value = raw.get(key)
        if value is not None and type(value) is not kind:
            raise BadFrame(f"meta.{key} must be {what}, got {type(value).__name__}", req)
    names = raw.get("dropped_tool_names") or []
    if type(names) is not list or any(type(n) is not str for n in names):
        raise BadFrame("meta.dropped_tool_names must be an array of strings", req)
    indexes = raw.get("dropped_tool_indexes") or []
    if type(indexes) is not list or any(type(i) is not int for i in indexes):
        raise BadFrame("meta.dropped_tool_indexes must be an array of integers", req)
    return FinishMeta(raw.get("finish_reason"), raw.get("usage"), raw.get("model"),
                      raw.get("provider_response_id"), bool(raw.get("partial")),
                      tuple(names), tuple(indexes))


@dataclass(frozen=True, slots=True)
class Authorize:
    """C_AUTHORIZE: `attempt` becomes the only writer of the call (it must be above
    every epoch the sink has seen for it). `reset` voids what earlier attempts
    published (a `reset` event). `model`: only for the sink's drop log lines."""

    req: int | str
    call_id: str
    attempt: int
    reset: bool
    model: str | None = None


@dataclass(frozen=True, slots=True)
class Fence:
    """C_FENCE: close `attempt` (if current): nothing more of it is accepted."""

    req: int | str
    call_id: str
    attempt: int


@dataclass(frozen=True, slots=True)
class Rebind:
    """C_REBIND: after a sink restart, the attempt `from_attempt` that is still
    streaming (its worker holds `token`) writes on as `attempt`, above every
    epoch seen: its deltas continue the answer whose content is every delta
    since attempt `content_from`, with no reset. The sink answers the worker's
    T_HELLO with where to resume."""

    req: int | str
    call_id: str
    attempt: int
    from_attempt: int
    content_from: int
    token: int


@dataclass(frozen=True, slots=True)
class Adopt:
    """C_ADOPT (cluster mode, ARCHITECTURE §4.17): the call was taken over from a
    host that lost its lease, at `epoch`: the sink opens that epoch in the
    call's log (no write of the old owner is stored after it), stores what the
    log holds before it, and answers with that content's stats (refused
    `call_finished` with the done event if the log holds one)."""

    req: int | str
    call_id: str
    epoch: int


@dataclass(frozen=True, slots=True)
class Follow:
    """C_FOLLOW (cluster mode, ARCHITECTURE §4.17): a call another host runs,
    asked for here: the sink stores its log as a replica and follows it to its
    done, sending its events to the call's listeners as they are stored.
    Answered `{"done": bool}`."""

    req: int | str
    call_id: str


@dataclass(frozen=True, slots=True)
class Finish:
    """C_FINISH: append, commit and publish the call's `done` event, built from the
    current attempt's content and `meta`; `status`/`error` as in the public `done`."""

    req: int | str
    call_id: str
    status: CallStatus
    error: dict[str, Any] | None
    attempts: int
    meta: FinishMeta


@dataclass(frozen=True, slots=True)
class Stats:
    """C_STATS: the sink's counters."""

    req: int | str


FROM_NOW = -1  # AddSubscriber.from_seq: no replay, the events committed from now on


@dataclass(frozen=True, slots=True)
class ListenerOwner:
    """The identity whose share (sink/shares.py) a subscription uses, and its caps (0: none)."""

    name: str
    max_listeners: int = 0
    max_subscriptions: int = 0


def _owner_from_wire(raw: Any, req: int | str) -> ListenerOwner:
    if type(raw) is not list or len(raw) != 3 or type(raw[0]) is not str \
            or not 0 < len(raw[0]) <= 64:  # an identity name (protocol/keys.py NAME_RE)
        raise BadFrame("owner must be [name, max_listeners, max_subscriptions]", req)
    return ListenerOwner(raw[0], check_int(raw[1], "max_listeners", 0, req),
                         check_int(raw[2], "max_subscriptions", 0, req))


@dataclass(frozen=True, slots=True)
class AddSubscriber:
    """C_SUBSCRIBE: send the call's events after `from_seq` to `listener` (a
    connection to the events socket), then its new ones as they commit.
    `live`: the call has not ended (the sink may not know it yet: queued);
    otherwise its events are replayed from the transcript and the reply is
    refused if it holds none. `owner`: whose share it uses (wire: its fields)."""

    req: int | str
    call_id: str
    listener: str
    from_seq: int
    live: bool
    owner: ListenerOwner


ControlOp = Authorize | Fence | Rebind | Finish | Stats | AddSubscriber | Adopt | Follow


def encode_control(op: ControlOp) -> bytes:
    msg: list[Any]
    if isinstance(op, Authorize):
        msg = [C_AUTHORIZE, op.req, op.call_id, op.attempt, op.reset, op.model]
    elif isinstance(op, Fence):
        msg = [C_FENCE, op.req, op.call_id, op.attempt]
    elif isinstance(op, Rebind):
        msg = [C_REBIND, op.req, op.call_id, op.attempt, op.from_attempt, op.content_from,
               op.token]
    elif isinstance(op, Finish):
        msg = [C_FINISH, op.req, op.call_id, op.status.value, op.error, op.attempts,
               meta_to_wire(op.meta)]
    elif isinstance(op, AddSubscriber):
        msg = [C_SUBSCRIBE, op.req, op.call_id, op.listener, op.from_seq, op.live,
               [op.owner.name, op.owner.max_listeners, op.owner.max_subscriptions]]
    elif isinstance(op, Adopt):
        msg = [C_ADOPT, op.req, op.call_id, op.epoch]
    elif isinstance(op, Follow):
        msg = [C_FOLLOW, op.req, op.call_id]
    else:
        msg = [C_STATS, op.req]
    packed: bytes = msgpack.packb(msg, use_bin_type=True)
    return packed


MAX_REQ_STR = 256
_CONTROL_ARITY = {C_AUTHORIZE: (5, 6, 7), C_FENCE: (4,), C_FINISH: (7,), C_STATS: (2,),
                  C_SUBSCRIBE: (7,), C_REBIND: (7,), C_ADOPT: (4,),
                  C_FOLLOW: (3,)}


def parse_control(obj: Any) -> ControlOp:
    """One decoded control message (untrusted). Raises BadFrame only."""
    if type(obj) is not list or len(obj) < 2:
        raise BadFrame("a control message must be an array [tag, req, ...]")
    tag, req = obj[0], obj[1]
    if type(req) is not int and not (type(req) is str and len(req) <= MAX_REQ_STR):
        raise BadFrame("req must be an integer or a short string")
    arity = _CONTROL_ARITY.get(tag) if type(tag) is int else None
    if arity is None:
        raise BadFrame(f"unknown control tag {tag!r}", req)
    if len(obj) not in arity:
        raise BadFrame(f"control tag {tag} takes {' or '.join(map(str, arity))} elements", req)
    if tag == C_STATS:
        return Stats(req)
    call_id = check_call_id(obj[2], req)
    if tag == C_FENCE:
        return Fence(req, call_id, check_int(obj[3], "attempt", 1, req))
    if tag == C_ADOPT:
        return Adopt(req, call_id, check_int(obj[3], "epoch", 1, req))
    if tag == C_FOLLOW:
        return Follow(req, call_id)
    if tag == C_REBIND:
        return Rebind(req, call_id, check_int(obj[3], "attempt", 1, req),
                      check_int(obj[4], "from_attempt", 1, req),
                      check_int(obj[5], "content_from", 1, req), check_int(obj[6], "token", 0, req))
    if tag == C_SUBSCRIBE:
        listener, live = obj[3], obj[5]
        if type(listener) is not str or not LISTENER_RE.fullmatch(listener):
            raise BadFrame("listener must be a listener id", req)
        if type(live) is not bool:
            raise BadFrame("live must be a boolean", req)
        from_seq = check_int(obj[4], "from_seq", FROM_NOW, req)
        return AddSubscriber(req, call_id, listener, from_seq, live, _owner_from_wire(obj[6], req))
    if tag == C_AUTHORIZE:
        reset = obj[4]
        if type(reset) is not bool:
            raise BadFrame("reset must be a boolean", req)
        model = obj[5] if len(obj) >= 6 else None
        if model is not None and type(model) is not str:
            raise BadFrame("model must be a string or nil", req)
        return Authorize(req, call_id, check_int(obj[3], "attempt", 1, req), reset, model)
    status = obj[3]
    if type(status) is not str or status not in _STATUSES:
        raise BadFrame(f"status must be one of {sorted(_STATUSES)}", req)
    if obj[4] is not None and type(obj[4]) is not dict:
        raise BadFrame("error must be a map or nil", req)
    return Finish(req, call_id, CallStatus(status), obj[4], check_int(obj[5], "attempts", 0, req),
                  meta_from_wire(obj[6], req))


_STATUSES = frozenset(s.value for s in CallStatus)


def encode_ok(req: int | str, payload: Any) -> bytes:
    """R_OK. payload: AUTHORIZE/FENCE the AttemptStats (wire form) of the attempt
    current before (attempt 0 for a new call); REBIND those of the attempt that
    writes on; ADOPT those of the content the call's log holds; FINISH [the done
    event, [[attempt, deltas refused], ...]] (none on a repeated finish); STATS the counters map; FOLLOW {"done": bool}; SUBSCRIBE nil."""
    packed: bytes = msgpack.packb([R_OK, req, payload], use_bin_type=True)
    return packed


def encode_refused(req: int | str, reason: str) -> bytes:
    packed: bytes = msgpack.packb([R_REFUSED, req, reason], use_bin_type=True)
    return packed


def encode_ended(call_id: str, attempt: int, stats: AttemptStats,
                 outcome: AttemptOutcome) -> bytes:
    """E_ENDED: the sink accepted the attempt's final."""
    packed: bytes = msgpack.packb([E_ENDED, call_id, attempt, stats_to_wire(stats),
                                   outcome_to_wire(outcome)], use_bin_type=True)
    return packed


def encode_final_refused(call_id: str, attempt: int, reason: str) -> bytes:
    packed: bytes = msgpack.packb([E_FINAL_REFUSED, call_id, attempt, reason],
                                  use_bin_type=True)
    return packed


def encode_lost(call_id: str, attempt: int, reason: str) -> bytes:
    """E_LOST: cluster mode, the call's run was refused by the cluster (ARCHITECTURE §4.17)."""
    packed: bytes = msgpack.packb([E_LOST, call_id, attempt, reason], use_bin_type=True)
    return packed


def encode_followed_done(call_id: str, done: dict[str, Any]) -> bytes:
    """E_FOLLOWED_DONE: a followed call's done is stored here (cluster mode)."""
    packed: bytes = msgpack.packb([E_FOLLOWED_DONE, call_id, done], use_bin_type=True)
    return packed


@dataclass(frozen=True, slots=True)
class Reply:
    """R_OK / R_REFUSED. `payload`: the reply's payload (ok) or the reason."""

    req: int
    ok: bool
    payload: Any


@dataclass(frozen=True, slots=True)
class Ended:
    call_id: str
    attempt: int
    stats: AttemptStats
    outcome: AttemptOutcome


@dataclass(frozen=True, slots=True)
class FinalRefused:
    call_id: str
    attempt: int
    reason: str


@dataclass(frozen=True, slots=True)
class Lost:
    call_id: str
    attempt: int
    reason: str


@dataclass(frozen=True, slots=True)
class FollowedDone:
    call_id: str
    done: dict[str, Any]


FromSink = Reply | Ended | FinalRefused | Lost | FollowedDone


def parse_from_sink(msg: list[Any]) -> FromSink:
    """A decoded sink.ctl message, on the supervisor's side (its own sink: a
    malformed outcome raises BadOutcome, an unknown tag BadFrame)."""
    tag = msg[0]
    if tag in (R_OK, R_REFUSED):
        return Reply(msg[1], tag == R_OK, msg[2])
    if tag == E_ENDED:
        return Ended(msg[1], msg[2], stats_from_wire(msg[3]), outcome_from_wire(msg[4]))
    if tag == E_FINAL_REFUSED:
        return FinalRefused(msg[1], msg[2], msg[3])
    if tag == E_LOST:
        return Lost(msg[1], msg[2], msg[3])
    if tag == E_FOLLOWED_DONE:
        return FollowedDone(msg[1], msg[2])
    raise BadFrame(f"unexpected message tag {tag!r}")
