"""The sink's side of the worker wire's messages and its per-delta byte pieces.

- `parse_final` validates a decoded T_FINAL (from `decode_untrusted`) into a
  `Final` or raises `BadFrame`; its outcome is parsed once, with
  `protocol.internal.outcome_from_wire` (a bad outcome is a bad frame).
- T_DELTA messages are parsed in the sink's hot path (process.py `_take`) with
  the same rules: `[T_DELTA, call_id: str, attempt: int, seq: int, kind, data]`,
  `kind` a DeltaKind, `data` a string or, for tool_call, a fragment map.
- `delta_prefix` / `KIND_TAIL` are the constant parts of the public delta
  event, so the hot path packs only seq and data. They are derived from
  `protocol.messages.delta_event`, and a test checks the bytes equal
  `encode(delta_event(...))`: those bytes are stored, and sent to subscribers as they are.

The supervisor's control messages are parsed by `protocol.internal.parse_control`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from streamfence.protocol.codec import encode
from streamfence.protocol.internal import T_FINAL, T_HELLO, T_REBIND
from streamfence.protocol.internal.control import BadFrame, check_call_id, check_int
from streamfence.protocol.internal.outcome import AttemptOutcome, BadOutcome, outcome_from_wire
from streamfence.protocol.messages import DeltaKind, delta_event

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


# ---- T_HELLO / T_REBIND ---------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Hello:
    """A worker's first message on a connection opened again mid-attempt."""

    call_id: str
    attempt: int
    token: int


def parse_hello(obj: Any) -> Hello:
    """`[T_HELLO, call_id, attempt, token]`."""
    if type(obj) is not list or len(obj) != 4 or obj[0] != T_HELLO or type(obj[0]) is not int:
        raise BadFrame("not a T_HELLO array of 4 elements")
    return Hello(check_call_id(obj[1]), check_int(obj[2], "attempt", 1),
                 check_int(obj[3], "token", 0))


def rebind_frame(hello: Hello, new_attempt: int, resume_after: int) -> bytes:
    """The answer to `hello`: write on as `new_attempt` after seq `resume_after`
    (0: the attempt is over)."""
    return encode([T_REBIND, hello.call_id, hello.attempt, new_attempt, resume_after])


# ---- T_FINAL -----------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Final:
    call_id: str
    attempt: int
    last_seq: int
    outcome: AttemptOutcome


def parse_final(obj: Any) -> Final:
    """`[T_FINAL, call_id, attempt, last_seq, outcome_to_wire(outcome)]`."""
    if type(obj) is not list or len(obj) != 5 or obj[0] != T_FINAL or type(obj[0]) is not int:
        raise BadFrame("not a T_FINAL array of 5 elements")
    try:
        outcome = outcome_from_wire(obj[4])
    except BadOutcome as exc:
        raise BadFrame(str(exc)) from None
    return Final(check_call_id(obj[1]), check_int(obj[2], "attempt", 1),
                 check_int(obj[3], "last_seq", 0), outcome)
