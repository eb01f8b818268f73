"""Public protocol v1: the client-facing messages as frozen dataclasses.

`parse_request(obj)` turns a decoded map into one request record or raises
ProtocolError with a precise code and the offending field named. The replies
and events a client receives are built by the `*_msg` helpers so their field
names live in one place. docs/PROTOCOL.md is the prose version of this module.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from streamfence.protocol.codec import decode_untrusted
from streamfence.protocol.errors import ErrorCode, ProtocolError
from streamfence.protocol.fields import MAX_REF_LEN, bad_field, field_of, non_empty, ref_field
from streamfence.protocol.queries import Calls, Usage, parse_calls, parse_usage

VERSION = 1
LISTENER_RE = re.compile(r"[A-Za-z0-9_-]{16,64}")  # a listener id: a secret, 16-64 chars


def events_endpoint(endpoint: str) -> str:
    """The events endpoint of the daemon whose client endpoint is `endpoint`:
    tcp://HOST:PORT -> tcp://HOST:PORT+1, ipc://PATH -> ipc://PATH.events
    (docs/PROTOCOL.md §1). Raises ValueError for anything else."""
    if endpoint.startswith("ipc://"):
        return endpoint + ".events"
    host, sep, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and sep and port.isdigit() and 0 < int(port) < 65535:
        return f"{host}:{int(port) + 1}"
    raise ValueError(f"endpoint {endpoint!r} is neither tcp://HOST:PORT (a port below 65535) "
                     "nor ipc://PATH")


class Op(StrEnum):
    # client -> daemon
    SUBMIT = "submit"
    SUBSCRIBE = "subscribe"
    RESULT = "result"
    CANCEL = "cancel"
    STATUS = "status"
    USAGE = "usage"
    CALLS = "calls"
    # client -> daemon's events socket, and the answer to `listen`
    LISTEN = "listen"
    ACK = "ack"
    LISTENING = "listening"
    # daemon -> client
    ACCEPTED = "accepted"
    ERROR = "error"
    PENDING = "pending"
    CANCELLING = "cancelling"
    STATUS_REPLY = "status_reply"
    USAGE_REPLY = "usage_reply"
    CALLS_REPLY = "calls_reply"
    DELTA = "delta"
    RESET = "reset"
    DONE = "done"
    CUT_OFF = "cut_off"


class DeltaKind(StrEnum):
    TEXT = "text"
    REASONING = "reasoning"
    TOOL_CALL = "tool_call"
    REFUSAL = "refusal"
    NOTICE = "notice"


# What a user has seen of an answer: text and refusal deltas, whitespace aside.
# "Visible text delivered" decides partial vs retry (on_partial) and is defined
# here only: the sink counts it per attempt, the worker per delta for its logs.
VISIBLE_KINDS = frozenset({DeltaKind.TEXT.value, DeltaKind.REFUSAL.value})


def visible_chars(kind: str, data: object) -> int:
    """The visible characters one delta adds (0 for any other kind)."""
    return len(data.strip()) if kind in VISIBLE_KINDS and isinstance(data, str) else 0


class CallStatus(StrEnum):
    COMPLETED = "completed"
    PARTIAL = "partial"
    FAILED = "failed"
    CANCELLED = "cancelled"


class OnPartial(StrEnum):
    CONTINUE = "continue"
    RESTART = "restart"


@dataclass(frozen=True, slots=True)
class CallOptions:
    stale_timeout_s: float | None = None
    first_chunk_timeout_s: float | None = None
    max_attempts: int | None = None
    deadline_s: float | None = None
    on_partial: OnPartial = OnPartial.CONTINUE
    traceparent: str | None = None  # W3C trace context: the call's span joins that trace

    def to_map(self) -> dict[str, Any]:
        return {
            "traceparent": self.traceparent,
            "stale_timeout_s": self.stale_timeout_s,
            "first_chunk_timeout_s": self.first_chunk_timeout_s,
            "max_attempts": self.max_attempts,
            "deadline_s": self.deadline_s,
            "on_partial": str(self.on_partial),
        }


@dataclass(frozen=True, slots=True)
class CallSpec:
    provider: str
    request: dict[str, Any]
    session_id: str | None = None
    idempotency_key: str | None = None
    options: CallOptions = field(default_factory=CallOptions)


@dataclass(frozen=True, slots=True)
class Submit:
    ref: str
    call: CallSpec
    listener: str | None = None  # subscribed from seq 1 (None: nobody)


@dataclass(frozen=True, slots=True)
class Subscribe:
    ref: str
    call_id: str
    listener: str
    from_seq: int = 0


@dataclass(frozen=True, slots=True)
class Result:
    ref: str
    call_id: str
    wait_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Cancel:
    ref: str
    call_id: str


@dataclass(frozen=True, slots=True)
class Status:
    ref: str


Request = Submit | Subscribe | Result | Cancel | Status | Usage | Calls


def _options(m: dict[str, Any] | None) -> CallOptions:
    if m is None:
        return CallOptions()
    p = "call.options."
    known = {"stale_timeout_s", "first_chunk_timeout_s", "max_attempts", "deadline_s", "on_partial",
             "traceparent"}
    for key in m:
        if key not in known:
            raise bad_field(p + str(key), "is not a known option")
    stale = field_of(m, "stale_timeout_s", (int, float), p, required=False)
    first = field_of(m, "first_chunk_timeout_s", (int, float), p, required=False)
    attempts = field_of(m, "max_attempts", int, p, required=False)
    deadline = field_of(m, "deadline_s", (int, float), p, required=False)
    on_partial = field_of(m, "on_partial", str, p, required=False)
    for name, val in (("stale_timeout_s", stale), ("first_chunk_timeout_s", first),
                      ("deadline_s", deadline)):
        if val is not None and not (0 < val < 1e7):
            raise bad_field(p + name, "must be a positive number of seconds")
    if attempts is not None and not (1 <= attempts <= 100):
        raise bad_field(p + "max_attempts", "must be between 1 and 100")
    if on_partial is not None and on_partial not in ("continue", "restart"):
        raise bad_field(p + "on_partial", 'must be "continue" or "restart"')
    traceparent = field_of(m, "traceparent", str, p, required=False)
    if traceparent is not None and not valid_traceparent(traceparent):
        raise bad_field(p + "traceparent", "must be a W3C traceparent: "
                   "00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>, ids not all zero")
    return CallOptions(
        traceparent=traceparent,
        stale_timeout_s=None if stale is None else float(stale),
        first_chunk_timeout_s=None if first is None else float(first),
        max_attempts=attempts,
        deadline_s=None if deadline is None else float(deadline),
        on_partial=OnPartial(on_partial or "continue"),
    )


_TRACEPARENT = re.compile(r"[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")


def valid_traceparent(value: str) -> bool:
    """A W3C `traceparent` header's value (version ff is invalid, and so are
    ids of zeros)."""
    match = _TRACEPARENT.fullmatch(value)
    return match is not None and not value.startswith("ff") and (
        match[1].strip("0") != "" and match[2].strip("0") != "")


def _call(m: dict[str, Any]) -> CallSpec:
    provider = non_empty(field_of(m, "provider", str, "call."), "call.provider")
    request = field_of(m, "request", dict, "call.")
    if "stream" in request:
        raise bad_field("call.request.stream", "must not be set: streamfence always streams")
    for key in request:
        if not isinstance(key, str):
            raise bad_field("call.request", "must have string keys")
    session = field_of(m, "session_id", str, "call.", required=False)
    idem = field_of(m, "idempotency_key", str, "call.", required=False)
    for name, val in (("session_id", session), ("idempotency_key", idem)):
        if val is not None and len(val) > MAX_REF_LEN:
            raise bad_field("call." + name, f"is longer than {MAX_REF_LEN} characters")
    return CallSpec(provider=provider, request=request, session_id=session,
                    idempotency_key=idem or None,
                    options=_options(field_of(m, "options", dict, "call.", required=False)))


def submitted_request(frame: bytes, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The request of a stored submit frame, with the fields the daemon set on
    admission (`overrides`: a capped field filled in). A large request is kept
    as the frame its client sent (docs/ARCHITECTURE.md §4.10), never encoded
    again; the worker and recovery read it back with this."""
    call = decode_untrusted(frame, len(frame))["call"]
    return {**call["request"], **overrides}


def parse_request(obj: Any) -> Request:
    """Validate one decoded client message. Raises ProtocolError only."""
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.BAD_MESSAGE,
                            f"a message must be a map, got {type(obj).__name__}")
    if "v" not in obj:
        raise bad_field("v", "is missing")
    if obj["v"] != VERSION or isinstance(obj["v"], bool):
        raise ProtocolError(ErrorCode.UNSUPPORTED_VERSION,
                            f"protocol version {obj['v']!r} is not supported; this daemon speaks v{VERSION}")
    op = field_of(obj, "op", str, "")
    if op == Op.SUBMIT:
        ref, call = ref_field(obj), _call(field_of(obj, "call", dict, ""))
        subscribe = field_of(obj, "subscribe", bool, "", required=False)
        listener = _listener(obj, required=bool(subscribe))
        return Submit(ref=ref, call=call, listener=None if subscribe is False else listener)
    if op == Op.SUBSCRIBE:
        ref, call_id = ref_field(obj), field_of(obj, "call_id", str, "")
        from_seq = field_of(obj, "from_seq", int, "", required=False) or 0
        if from_seq < 0:
            raise bad_field("from_seq", "must not be negative")
        listener = _listener(obj, required=True)
        assert listener is not None
        return Subscribe(ref=ref, call_id=call_id, listener=listener, from_seq=from_seq)
    if op == Op.RESULT:
        wait = field_of(obj, "wait_s", (int, float), "", required=False) or 0.0
        if not (0 <= wait <= 3600):
            raise bad_field("wait_s", "must be between 0 and 3600")
        return Result(ref=ref_field(obj), call_id=field_of(obj, "call_id", str, ""), wait_s=float(wait))
    if op == Op.CANCEL:
        return Cancel(ref=ref_field(obj), call_id=field_of(obj, "call_id", str, ""))
    if op == Op.STATUS:
        return Status(ref=ref_field(obj))
    if op == Op.USAGE:
        return parse_usage(obj)
    if op == Op.CALLS:
        return parse_calls(obj)
    raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {op!r}")



def parse_listener_msg(obj: Any) -> int | None:
    """Validate a message on the events socket: `listen` (None) or `ack`, whose
    `read` (the bytes of frames read since the last `listen`) is returned."""
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.BAD_MESSAGE,
                            f"a message must be a map, got {type(obj).__name__}")
    if obj.get("v") != VERSION or isinstance(obj.get("v"), bool):
        raise ProtocolError(ErrorCode.UNSUPPORTED_VERSION,
                            f"protocol version {obj.get('v')!r} is not supported; this daemon "
                            f"speaks v{VERSION}")
    op = obj.get("op")
    if op == Op.LISTEN:
        return None
    if op == Op.ACK:
        read: int = field_of(obj, "read", int, "")
        if read < 0:
            raise bad_field("read", "must be at least 0")
        return read
    raise ProtocolError(ErrorCode.UNKNOWN_OP, f"the events socket takes only 'listen' and "
                        f"'ack', got {op!r}; requests go to the client endpoint")


def _listener(m: dict[str, Any], required: bool) -> str | None:
    """Where a call's events go: the id of a connection to the events socket."""
    listener: str | None = field_of(m, "listener", str, "", required=required)
    if listener is not None and not LISTENER_RE.fullmatch(listener):
        raise bad_field("listener", "must be 16 to 64 characters from A-Z a-z 0-9 _ -")
    return listener


def ref_of(obj: Any) -> str | None:
    """Best-effort `ref` of a message that failed validation, to echo in the error."""
    if isinstance(obj, dict):
        ref = obj.get("ref")
        if isinstance(ref, str) and len(ref) <= MAX_REF_LEN:
            return ref
    return None


# ---- replies and events (daemon -> client) ---------------------------------

def error_msg(ref: str | None, code: ErrorCode, message: str) -> dict[str, Any]:
    return {"v": VERSION, "op": Op.ERROR.value, "ref": ref, "code": code.value, "message": message}


def accepted_msg(ref: str, call_id: str, duplicate: bool = False) -> dict[str, Any]:
    return {"v": VERSION, "op": Op.ACCEPTED.value, "ref": ref, "call_id": call_id,
            "duplicate": duplicate}


def listening_msg(link: dict[str, Any] | None = None) -> dict[str, Any]:
    """`link`: the sink's offer of a plain link, {"path": str, "token": bin} (PROTOCOL §5)."""
    msg: dict[str, Any] = {"v": VERSION, "op": Op.LISTENING.value}
    if link is not None:
        msg["link"] = link
    return msg


def pending_msg(ref: str, call_id: str) -> dict[str, Any]:
    return {"v": VERSION, "op": Op.PENDING.value, "ref": ref, "call_id": call_id}


def delta_event(call_id: str, attempt: int, seq: int, kind: str, data: Any) -> dict[str, Any]:
    return {"v": VERSION, "op": Op.DELTA.value, "call_id": call_id, "attempt": attempt,
            "seq": seq, "kind": kind, "data": data}


def reset_event(call_id: str, attempt: int, seq: int) -> dict[str, Any]:
    return {"v": VERSION, "op": Op.RESET.value, "call_id": call_id, "attempt": attempt, "seq": seq}


def cut_off_event(call_id: str, seq: int, reason: str) -> dict[str, Any]:
    """The events socket stopped sending `call_id` to this listener after `seq`:
    subscribe again from there (PROTOCOL §5, "Flow control")."""
    return {"v": VERSION, "op": Op.CUT_OFF.value, "call_id": call_id, "seq": seq,
            "reason": reason}


def done_event(call_id: str, seq: int, status: CallStatus, response: dict[str, Any] | None,
               error: dict[str, Any] | None, attempts: int) -> dict[str, Any]:
    return {"v": VERSION, "op": Op.DONE.value, "call_id": call_id, "seq": seq,
            "status": status.value, "response": response, "error": error, "attempts": attempts}


def empty_response() -> dict[str, Any]:
    """The normalized response of a `done` event (docs/PROTOCOL.md §6), every field present."""
    return {"content": "", "reasoning": "", "tool_calls": [], "refusal": None,
            "finish_reason": None, "usage": None, "model": None,
            "provider_response_id": None, "partial": False, "dropped_tool_names": [],
            "content_omitted": False}
