"""The sink's side of `streamfence.protocol.internal`: shape checks and pre-encoded pieces.

- `parse_final` / `parse_control` validate a decoded frame (from
  `decode_untrusted`) into a frozen record or raise `BadFrame` (with the
  request id when one could be read, so the supervisor still gets a reply).
- T_DELTA frames are parsed inline in the sink's hot loop (process.py) with
  the same rules: `[T_DELTA, call_id: str, attempt: int, seq: int, kind, data]`,
  `kind` a DeltaKind, `data` a string or, for tool_call, a fragment map.
- `delta_prefix` / `KIND_TAIL` / `event_head` are the constant parts of the
  frames the sink sends per delta, so the hot path packs only seq and data.
  They are derived from `streamfence.protocol.messages.delta_event`, and a test checks
  the bytes equal `encode(delta_event(...))`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from streamfence.protocol.codec import encode
from streamfence.protocol.internal import C_AUTHORIZE, C_FENCE, C_FINISH, C_STATS, E_EVENT, T_FINAL
from streamfence.protocol.messages import CallStatus, DeltaKind, delta_event

MAX_CALL_ID = 256
MAX_REQ_STR = 256
_STATUSES = frozenset(s.value for s in CallStatus)


class BadFrame(Exception):
    """A frame the sink cannot accept. `req` is set when the request id was readable."""

    def __init__(self, reason: str, req: int | str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.req = req


# ---- pre-encoded pieces ------------------------------------------------------

_TAIL_KEYS = ["seq", "kind", "data"]


def delta_prefix(call_id: str, attempt: int) -> bytes:
    """Encoded `delta_event` map up to and including the "seq" key."""
    template = delta_event(call_id, attempt, 0, "", "")
    keys = list(template)
    if keys[-3:] != _TAIL_KEYS or len(keys) > 15:
        raise RuntimeError("delta_event's layout changed: update streamfence.sink.wire")
    parts = [bytes([0x80 | len(keys)])]  # fixmap header
    for key in keys[:-3]:
        parts.append(encode(key))
        parts.append(encode(template[key]))
    parts.append(encode("seq"))
    return b"".join(parts)


# kind -> encoded '"kind": kind, "data"' (the data value follows).
KIND_TAIL: dict[str, bytes] = {
    k.value: encode("kind") + encode(k.value) + encode("data") for k in DeltaKind
}
TOOL_CALL = DeltaKind.TOOL_CALL.value


def event_head(call_id: str) -> bytes:
    """Encoded `[E_EVENT, call_id, ` (array header and two elements); seq and
    the event bytes follow."""
    return b"\x94" + encode(E_EVENT) + encode(call_id)


# ---- records -----------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Final:
    call_id: str
    attempt: int
    last_seq: int
    final: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Authorize:
    req: int | str
    call_id: str
    attempt: int
    reset: bool
    model: str | None = None  # optional 6th element: only used in drop log lines


@dataclass(frozen=True, slots=True)
class Fence:
    req: int | str
    call_id: str
    attempt: int


@dataclass(frozen=True, slots=True)
class Finish:
    req: int | str
    call_id: str
    status: CallStatus
    error: dict[str, Any] | None
    attempts: int
    meta: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class Stats:
    req: int | str


ControlOp = Authorize | Fence | Finish | Stats


# ---- field checks ---------------------------------------------------------------

def _call_id(value: Any, req: int | str | None = None) -> str:
    if type(value) is not str or not 0 < len(value) <= MAX_CALL_ID:
        raise BadFrame(f"call_id must be a string of 1..{MAX_CALL_ID} characters", req)
    return value


def _int(value: Any, name: str, minimum: int, req: int | str | None = None) -> int:
    # type() not isinstance(): a bool is not an attempt number.
    if type(value) is not int or value < minimum:
        raise BadFrame(f"{name} must be an integer >= {minimum}", req)
    return value


def _map_or_nil(value: Any, name: str, req: int | str) -> dict[str, Any] | None:
    if value is not None and type(value) is not dict:
        raise BadFrame(f"{name} must be a map or nil", req)
    return value


def parse_final(obj: Any) -> Final:
    """`[T_FINAL, call_id, attempt, last_seq, final]`."""
    if type(obj) is not list or len(obj) != 5 or obj[0] != T_FINAL or type(obj[0]) is not int:
        raise BadFrame("not a T_FINAL array of 5 elements")
    final = obj[4]
    if type(final) is not dict:
        raise BadFrame("final must be a map")
    return Final(_call_id(obj[1]), _int(obj[2], "attempt", 1), _int(obj[3], "last_seq", 0), final)


# tag -> allowed lengths
_ARITY = {C_AUTHORIZE: (5, 6), C_FENCE: (4,), C_FINISH: (7,), C_STATS: (2,)}


def parse_control(obj: Any) -> ControlOp:
    """One supervisor -> sink control message."""
    if type(obj) is not list or len(obj) < 2:
        raise BadFrame("a control message must be an array [tag, req, ...]")
    tag, req = obj[0], obj[1]
    if type(req) is not int and not (type(req) is str and len(req) <= MAX_REQ_STR):
        raise BadFrame("req must be an integer or a short string")
    arity = _ARITY.get(tag) if type(tag) is int else None
    if arity is None:
        raise BadFrame(f"unknown control tag {tag!r}", req)
    if len(obj) not in arity:
        raise BadFrame(f"control tag {tag} takes {' or '.join(map(str, arity))} elements", req)
    if tag == C_STATS:
        return Stats(req)
    call_id = _call_id(obj[2], req)
    if tag == C_AUTHORIZE:
        reset = obj[4]
        if type(reset) is not bool:
            raise BadFrame("reset must be a boolean", req)
        model = obj[5] if len(obj) == 6 else None
        if model is not None and type(model) is not str:
            raise BadFrame("model must be a string or nil", req)
        return Authorize(req, call_id, _int(obj[3], "attempt", 1, req), reset, model)
    if tag == C_FENCE:
        return Fence(req, call_id, _int(obj[3], "attempt", 1, req))
    status = obj[3]
    if type(status) is not str or status not in _STATUSES:
        raise BadFrame(f"status must be one of {sorted(_STATUSES)}", req)
    return Finish(req, call_id, CallStatus(status), _map_or_nil(obj[4], "error", req),
                  _int(obj[5], "attempts", 0, req), _map_or_nil(obj[6], "meta", req))
