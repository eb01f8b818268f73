"""Internal messages between the daemon's own processes.

All are single-frame msgpack arrays whose first element is a tag (small int),
chosen for the per-delta hot path: no map keys to encode, one `unpackb`.
Sockets (all `ipc://` endpoints in the daemon's runtime directory, see
`Endpoints`):

    worker DEALER ──► sink ROUTER       "sink.in"   deltas, finals; sink acks finals
    supervisor DEALER ◄─► sink ROUTER   "sink.ctl"  authorize/fence/finish + events
    worker DEALER ◄─► supervisor ROUTER "workers"   hello, run, idle
    worker PUSH ──► supervisor PULL     "logs"      log records of every child

Worker -> sink ("sink.in"):
    [T_DELTA, call_id, attempt, seq, kind, data]
        seq starts at 1 per attempt and is contiguous; kind is a DeltaKind.
    [T_FINAL, call_id, attempt, last_seq, final]
        final: map, see `FinalInfo` keys below. Sent exactly once per attempt,
        also when the attempt failed. The worker waits for the ack.
Sink -> worker:
    [T_FINAL_ACK, call_id, attempt, accepted: bool, reason: str]

Supervisor -> sink ("sink.ctl"), each carries a request id echoed by the reply
(records `Authorize`, `Fence`, `Finish`, `Stats`; `encode_control` /
`parse_control`):
    [C_AUTHORIZE, req, call_id, attempt, reset: bool, model: str|None]
    [C_FENCE, req, call_id, attempt]
    [C_FINISH, req, call_id, status, error, attempts, meta]   meta: FinishMeta map
    [C_STATS, req]
Sink -> supervisor (`parse_from_sink`; the events, one per delta, are
destructured in place by `supervisor.sinklink.SinkLink.drain`):
    [R_OK, req, payload]       `encode_ok`: AttemptStats for AUTHORIZE/FENCE,
                               the done event for FINISH, counters for STATS
    [R_REFUSED, req, reason]   `encode_refused`
    [E_EVENT, call_id, seq, event_bytes]            `event_head` / `encode_event`
    [E_EVENTS, [[E_EVENT, call_id, seq, event_bytes], ...]]   `EVENTS_BATCH_HEAD`
    [E_ENDED, call_id, attempt, stats, outcome]     `encode_ended` (outcome_to_wire)
    [E_FINAL_REFUSED, call_id, attempt, reason]     `encode_final_refused`
AttemptStats: [attempt, accepted, dropped, visible_chars, tool_fragments,
    last_seq, closed] (`stats_to_wire` / `stats_from_wire`).

FinalInfo map (worker -> sink, forwarded to the supervisor in E_ENDED):
    {"ok": bool, "finish_reason": str|None, "usage": map|None,
     "model": str|None, "provider_response_id": str|None,
     "dropped_tool_names": [str], "dropped_tool_indexes": [int],
     "error": None | {"class": "transient"|"final"|"context_overflow",
                      "code": str, "message": str, "status": int|None,
                      "retry_after_s": float|None},
     "diag": {"first_chunk_ms", "chunks", "bytes"}}

Supervisor -> worker ("workers"):
    [W_RUN, token, call_id, attempt, session_id, profile, request, settings]
        profile: the provider profile as a map (kind, base_url, api_key_env,
        region, ...); settings: {"connect_timeout_s", "read_timeout_s"}.
    [W_EXIT]
Worker -> supervisor:
    [W_HELLO, worker_id, pid]
    [W_IDLE, worker_id, token, final_accepted: bool]

Logs (worker PUSH -> supervisor PULL):
    [L_RECORD, {"name", "levelno", "levelname", "msg", "exc_text",
                "created", "process", "session_id", "call_id", "attempt"}]
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import msgpack

from streamfence.protocol.messages import CallStatus

# worker -> sink
T_DELTA = 0
T_FINAL = 1
T_FINAL_ACK = 2

# supervisor -> sink control
C_AUTHORIZE = 10
C_FENCE = 11
C_FINISH = 12
C_STATS = 13
R_OK = 20
R_REFUSED = 21
E_EVENT = 30
E_ENDED = 31
E_FINAL_REFUSED = 32
E_EVENTS = 33

# supervisor <-> worker
W_RUN = 40
W_EXIT = 41
W_HELLO = 42
W_IDLE = 43

L_RECORD = 50


@dataclass(frozen=True, slots=True)
class Endpoints:
    """The ipc endpoints of one daemon, all under one runtime directory."""

    runtime_dir: str

    def _ipc(self, name: str) -> str:
        return "ipc://" + os.path.join(self.runtime_dir, name)

    @property
    def sink_in(self) -> str:
        return self._ipc("sink.in")

    @property
    def sink_ctl(self) -> str:
        return self._ipc("sink.ctl")

    @property
    def workers(self) -> str:
        return self._ipc("workers")

    @property
    def logs(self) -> str:
        return self._ipc("logs")

    @property
    def liveness_file(self) -> str:
        return os.path.join(self.runtime_dir, "liveness.bin")


# ---- supervisor <-> sink ("sink.ctl") ----------------------------------------
# Each message: a record, one builder (`encode_*`) and one parser. The sink
# parses what it is sent as untrusted (`parse_control`: it refuses strangers
# but never crashes on a bad frame); the supervisor trusts its own sink.


class BadFrame(ValueError):
    """A frame without the shape of its message. `req` is set when the request
    id could be read, so that the sender can still be answered."""

    def __init__(self, reason: str, req: int | str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.req = req


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


ControlOp = Authorize | Fence | Finish | Stats


def encode_control(op: ControlOp) -> bytes:
    msg: list[Any]
    if isinstance(op, Authorize):
        msg = [C_AUTHORIZE, op.req, op.call_id, op.attempt, op.reset, op.model]
    elif isinstance(op, Fence):
        msg = [C_FENCE, op.req, op.call_id, op.attempt]
    elif isinstance(op, Finish):
        msg = [C_FINISH, op.req, op.call_id, op.status.value, op.error, op.attempts,
               meta_to_wire(op.meta)]
    else:
        msg = [C_STATS, op.req]
    packed: bytes = msgpack.packb(msg, use_bin_type=True)
    return packed


MAX_CALL_ID = 256
MAX_REQ_STR = 256
_CONTROL_ARITY = {C_AUTHORIZE: (5, 6), C_FENCE: (4,), C_FINISH: (7,), C_STATS: (2,)}


def check_call_id(value: Any, req: int | str | None = None) -> str:
    if type(value) is not str or not 0 < len(value) <= MAX_CALL_ID:
        raise BadFrame(f"call_id must be a string of 1..{MAX_CALL_ID} characters", req)
    return value


def check_int(value: Any, name: str, minimum: int, req: int | str | None = None) -> int:
    # type() not isinstance(): a bool is not an attempt number.
    if type(value) is not int or value < minimum:
        raise BadFrame(f"{name} must be an integer >= {minimum}", req)
    return value


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
    if tag == C_AUTHORIZE:
        reset = obj[4]
        if type(reset) is not bool:
            raise BadFrame("reset must be a boolean", req)
        model = obj[5] if len(obj) == 6 else None
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
    current before (attempt 0 for a new call); FINISH the done event; STATS the
    counters map."""
    packed: bytes = msgpack.packb([R_OK, req, payload], use_bin_type=True)
    return packed


def encode_refused(req: int | str, reason: str) -> bytes:
    packed: bytes = msgpack.packb([R_REFUSED, req, reason], use_bin_type=True)
    return packed


# E_EVENT [E_EVENT, call_id, seq, event_bytes]: an accepted public event
# (delta/reset/done), encoded as the map a subscriber receives (forwarded as is).
# E_EVENTS [E_EVENTS, [E_EVENT message, ...]]: the events of one commit, one
# decode per batch. Events go out only after the commit that stores them, in
# order: a subscriber never sees an event the transcript does not hold.


def event_head(call_id: str) -> bytes:
    """`[E_EVENT, call_id, ` pre-encoded: the sink's hot path appends the packed
    seq and event bytes."""
    head: bytes = b"\x94" + msgpack.packb(E_EVENT) + msgpack.packb(call_id, use_bin_type=True)
    return head


def encode_event(call_id: str, seq: int, event: bytes) -> bytes:
    packed: bytes = msgpack.packb([E_EVENT, call_id, seq, event], use_bin_type=True)
    return packed


EVENTS_BATCH_HEAD = b"\x92" + msgpack.packb(E_EVENTS)  # then an array of E_EVENT messages


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


FromSink = Reply | Ended | FinalRefused


def parse_from_sink(msg: list[Any]) -> FromSink:
    """A decoded sink.ctl message other than E_EVENT / E_EVENTS, on the
    supervisor's side (its own sink: a malformed outcome raises BadOutcome, an
    unknown tag BadFrame). The events, one per delta, are destructured in
    place by the supervisor's hot loop (`SinkLink.drain`): an E_EVENT is
    `[tag, call_id, seq, event]`, an E_EVENTS `[tag, [E_EVENT, ...]]`."""
    tag = msg[0]
    if tag in (R_OK, R_REFUSED):
        return Reply(msg[1], tag == R_OK, msg[2])
    if tag == E_ENDED:
        return Ended(msg[1], msg[2], stats_from_wire(msg[3]), outcome_from_wire(msg[4]))
    if tag == E_FINAL_REFUSED:
        return FinalRefused(msg[1], msg[2], msg[3])
    raise BadFrame(f"unexpected message tag {tag!r}")


# ---- the attempt outcome (worker -> sink -> supervisor) ---------------------


class ErrorClass(StrEnum):
    """How the supervisor treats a failed attempt."""

    TRANSIENT = "transient"  # retry with backoff
    FINAL = "final"  # no retry: the call fails
    CONTEXT_OVERFLOW = "context_overflow"  # no retry, the call fails with empty content


@dataclass(frozen=True, slots=True)
class AttemptError:
    """Why an attempt failed, already scrubbed of secrets (workers.errors builds it)."""

    error_class: ErrorClass
    code: str
    message: str
    status: int | None = None
    retry_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class AttemptDiag:
    """What the worker measured of its attempt (reported in `result`'s diagnostics)."""

    first_chunk_ms: float | None = None
    chunks: int = 0
    bytes: int = 0
    deltas: int = 0
    duration_ms: float | None = None


@dataclass(frozen=True, slots=True)
class AttemptOutcome:
    """How one attempt ended, as its worker saw it: built once by the adapter
    (or from the exception that ended it), sent to the sink in T_FINAL and
    forwarded to the supervisor in E_ENDED.

    `stream_options_rejected` / `streaming_denied`: the provider refused
    `stream_options` / the streaming action, so the supervisor remembers the
    fall-back for the profile."""

    ok: bool
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    model: str | None = None
    provider_response_id: str | None = None
    dropped_tool_names: tuple[str, ...] = ()
    dropped_tool_indexes: tuple[int, ...] = ()
    error: AttemptError | None = None
    diag: AttemptDiag = AttemptDiag()
    stream_options_rejected: bool = False
    streaming_denied: bool = False


# ---- W_RUN (supervisor -> worker) -----------------------------------------


@dataclass(frozen=True, slots=True)
class AttemptSettings:
    """How the worker runs one attempt (decided by the supervisor per attempt)."""

    streaming: bool = True  # False: the profile fell back to the non-streaming call
    include_usage: bool = True  # False: the provider refused `stream_options`
    connect_timeout_s: float = 30.0
    read_timeout_s: float = 120.0
    write_timeout_s: float = 600.0
    final_ack_timeout_s: float = 30.0
    notice: str | None = None  # a notice delta to emit before the stream's first


@dataclass(frozen=True, slots=True)
class RunAttempt:
    """W_RUN: run attempt `attempt` of `call_id` on this worker. `token` names the
    reservation (echoed in W_IDLE); `profile` is the provider profile as a map."""

    token: int
    call_id: str
    attempt: int
    session_id: str
    profile: dict[str, Any]
    request: dict[str, Any]
    settings: AttemptSettings


def encode_run(run: RunAttempt) -> bytes:
    s = run.settings
    packed: bytes = msgpack.packb(
        [W_RUN, run.token, run.call_id, run.attempt, run.session_id, run.profile, run.request,
         [s.streaming, s.include_usage, s.connect_timeout_s, s.read_timeout_s,
          s.write_timeout_s, s.final_ack_timeout_s, s.notice]], use_bin_type=True)
    return packed


def decode_run(msg: list[Any]) -> RunAttempt:
    """`msg`: the decoded W_RUN array (from the daemon's own supervisor, trusted)."""
    _, token, call_id, attempt, session_id, profile, request, settings = msg
    return RunAttempt(token, call_id, attempt, session_id, profile, request,
                      AttemptSettings(*settings))


# ---- the attempt outcome on the wire (T_FINAL, E_ENDED) ---------------------


def outcome_to_wire(o: AttemptOutcome) -> list[Any]:
    """The msgpack-ready form of `o` (a positional array, in field order)."""
    e, d = o.error, o.diag
    return [o.ok, o.finish_reason, o.usage, o.model, o.provider_response_id,
            list(o.dropped_tool_names), list(o.dropped_tool_indexes),
            None if e is None else [e.error_class.value, e.code, e.message, e.status,
                                    e.retry_after_s],
            [d.first_chunk_ms, d.chunks, d.bytes, d.deltas, d.duration_ms],
            o.stream_options_rejected, o.streaming_denied]


class BadOutcome(ValueError):
    """A T_FINAL outcome that does not have the shape of `outcome_to_wire`."""


def outcome_from_wire(raw: Any) -> AttemptOutcome:
    """Parse `outcome_to_wire`'s form. It crosses a process boundary (a worker runs
    provider code), so a bad shape raises BadOutcome, never anything else."""
    try:
        (ok, finish, usage, model, response_id, names, indexes, err, diag,
         so_rejected, denied) = raw
        error = None if err is None else AttemptError(ErrorClass(err[0]), str(err[1]),
                                                      str(err[2]), err[3], err[4])
        outcome = AttemptOutcome(
            bool(ok), finish, usage, model, response_id, tuple(str(n) for n in names),
            tuple(int(i) for i in indexes), error, AttemptDiag(*diag), bool(so_rejected),
            bool(denied))
    except (TypeError, ValueError, IndexError) as exc:
        raise BadOutcome(f"malformed attempt outcome: {exc}") from None
    if not (finish is None or isinstance(finish, str)) or not (
            usage is None or isinstance(usage, dict)):
        raise BadOutcome("malformed attempt outcome: finish_reason or usage")
    return outcome


# ---- the zygote pipe (supervisor <-> zygote) --------------------------------
# A multiprocessing pipe, not a socket (the zygote owns no ZeroMQ context: one must
# not cross a fork); each frame is a msgpack array, tag first. The tags are the
# strings the pipe has always carried, so either side can switch to these names first.


class ZygoteTag(StrEnum):
    """The first element of a zygote-pipe frame; one message type each (below)."""

    SPAWN = "spawn"  # supervisor -> zygote: fork worker `worker_id` on liveness slot `slot`
    STOP = "stop"  # supervisor -> zygote: kill the workers and exit
    READY = "ready"  # zygote -> supervisor: warmed up, forks from now on
    SPAWNED = "spawned"  # zygote -> supervisor: the worker's pid
    EXITED = "exited"  # zygote -> supervisor: a worker was reaped
    LOG = "log"  # zygote -> supervisor: one of its log records (the L_RECORD fields)


@dataclass(frozen=True, slots=True)
class SpawnWorker:
    worker_id: int
    slot: int


@dataclass(frozen=True, slots=True)
class StopZygote:
    pass


@dataclass(frozen=True, slots=True)
class ZygoteReady:
    pid: int


@dataclass(frozen=True, slots=True)
class WorkerSpawned:
    worker_id: int
    pid: int


@dataclass(frozen=True, slots=True)
class WorkerExited:
    worker_id: int  # -1: a child the zygote did not know
    pid: int
    returncode: int  # an ExitCode (protocol/lifecycle.py), or -N: killed by signal N


@dataclass(frozen=True, slots=True)
class ZygoteLog:
    fields: dict[str, Any]


ZygoteCommand = SpawnWorker | StopZygote
ZygoteEvent = ZygoteReady | WorkerSpawned | WorkerExited | ZygoteLog

_ZYGOTE_TAGS: dict[type, ZygoteTag] = {
    SpawnWorker: ZygoteTag.SPAWN, StopZygote: ZygoteTag.STOP, ZygoteReady: ZygoteTag.READY,
    WorkerSpawned: ZygoteTag.SPAWNED, WorkerExited: ZygoteTag.EXITED, ZygoteLog: ZygoteTag.LOG}
_ZYGOTE_TYPES = {tag: cls for cls, tag in _ZYGOTE_TAGS.items()}


def encode_zygote(msg: ZygoteCommand | ZygoteEvent) -> bytes:
    """The frame of any zygote-pipe message: [tag, *fields in declaration order]."""
    values = [getattr(msg, name) for name in msg.__match_args__]
    packed: bytes = msgpack.packb([_ZYGOTE_TAGS[type(msg)].value, *values], use_bin_type=True,
                                  default=str)
    return packed


def _decode_zygote(frame: bytes, allowed: tuple[type, ...]) -> Any:
    msg = msgpack.unpackb(frame, raw=False)
    try:
        cls = _ZYGOTE_TYPES.get(msg[0])
        if cls in allowed:
            return cls(*msg[1:])
    except (TypeError, IndexError, KeyError):
        pass
    raise ValueError(f"unexpected zygote-pipe message {str(msg)[:100]}")


def decode_zygote_command(frame: bytes) -> ZygoteCommand:
    """A frame the supervisor sent (ValueError for anything else)."""
    cmd: ZygoteCommand = _decode_zygote(frame, (SpawnWorker, StopZygote))
    return cmd


def decode_zygote_event(frame: bytes) -> ZygoteEvent:
    """A frame the zygote sent (ValueError for anything else)."""
    event: ZygoteEvent = _decode_zygote(frame, (ZygoteReady, WorkerSpawned, WorkerExited,
                                                ZygoteLog))
    return event
