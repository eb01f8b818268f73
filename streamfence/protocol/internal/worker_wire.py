"""The worker wire: the messages between a worker and the sink.

A worker writes to the sink's AF_UNIX stream socket "sink.stream" msgpack
arrays back to back (msgpack is its own framing; workers/sink_channel.py,
sink/streams.py), the deltas of one provider read in one write; "sink.in" takes the same messages one ZeroMQ frame each
(tests, tools). Each message has one builder (`*_frame`) and one parser
(`parse_*`); a parser takes the decoded array (`codec.untrusted_unpacker` or
`codec.decode_untrusted`: it comes from another process) and raises only
`BadFrame`.

Worker -> sink:
    [T_DELTA, call_id, attempt, seq, kind, data]   `delta_frame` / `parse_delta`
        seq starts at 1 per attempt and is contiguous; kind is a DeltaKind
        value; data a string or, for tool_call, a fragment map
        {"index": int 0..MAX_TOOL_INDEX, "id": str|nil, "name": str|nil,
        "arguments": str|nil} (`check_tool_fragment`; workers/output.py says
        what the fields mean).
    [T_FINAL, call_id, attempt, last_seq, outcome]   `final_frame` / `parse_final`
        outcome: `outcome.outcome_to_wire(AttemptOutcome)`. Sent exactly once
        per attempt, also when the attempt failed; the worker waits for the ack.
    [T_HELLO, call_id, attempt, token]   `hello_frame` / `parse_hello`
        Sent first in every attempt, and first on a connection opened again
        mid-attempt (the sink it wrote to died): the worker holds its deltas
        until the answer. token: the reservation of the worker's run (W_RUN's).
Sink -> worker (`parse_sink_reply` parses both):
    [T_FINAL_ACK, call_id, attempt, accepted: bool, reason: str]   `final_ack_frame`
        reason: "" when accepted, "repeated" for a final accepted before.
    [T_REBIND, call_id, attempt, new_attempt, resume_after]   `rebind_frame`
        The answer to T_HELLO: write on as `new_attempt`, from seq
        resume_after + 1 (what the transcript holds of the answer is durable);
        new_attempt 0: the attempt is over, write nothing more.

The per-delta path: `delta_frame` is the worker's one call per delta. The
sink does not call `parse_delta`: its per-delta loop (sink/intake.py
`_take`) applies the same checks inline, since a call per delta costs about
a quarter of the parse (it uses `check_tool_fragment` and `TOOL_CALL` from
here); tests/test_protocol_worker_wire.py checks `parse_delta` refuses the
frames tests/test_sink_robustness.py sees the sink refuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from streamfence.protocol.internal import T_DELTA, T_FINAL, T_FINAL_ACK, T_HELLO, T_REBIND
from streamfence.protocol.internal.checks import BadFrame, check_call_id, check_int
from streamfence.protocol.internal.outcome import AttemptOutcome, BadOutcome, outcome_from_wire
from streamfence.protocol.messages import DeltaKind

TOOL_CALL = DeltaKind.TOOL_CALL.value
KINDS = frozenset(k.value for k in DeltaKind)
_TOOL_KEYS = frozenset(("index", "id", "name", "arguments"))
MAX_TOOL_INDEX = 4096

# One packer for every frame built here (it holds the GIL while it packs).
_pack = msgpack.Packer(use_bin_type=True, datetime=False).pack


def _is_tag(obj: Any, tag: int, length: int) -> bool:
    # type() not ==: True == 1, and a bool is not a tag.
    return type(obj) is list and len(obj) == length and type(obj[0]) is int and obj[0] == tag


# ---- T_DELTA -----------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Delta:
    call_id: str
    attempt: int
    seq: int
    kind: str
    data: Any  # a str, or a tool_call fragment map


def delta_frame(call_id: str, attempt: int, seq: int, kind: str, data: Any) -> bytes:
    """`[T_DELTA, call_id, attempt, seq, kind, data]` (the worker's per-delta call)."""
    return _pack((T_DELTA, call_id, attempt, seq, kind, data))  # type: ignore[no-any-return]


def check_tool_fragment(data: Any) -> dict[str, Any]:
    """Validate one `tool_call` delta payload; raises BadFrame naming the field."""
    if type(data) is not dict:
        raise BadFrame("tool_call data must be a map")
    for key in data:
        if key not in _TOOL_KEYS:
            raise BadFrame(f"tool_call data has unknown field {key!r}")
    index = data.get("index")
    if type(index) is not int or not 0 <= index <= MAX_TOOL_INDEX:
        raise BadFrame(f"tool_call.index must be an integer in 0..{MAX_TOOL_INDEX}")
    for key in ("id", "name", "arguments"):
        value = data.get(key)
        if value is not None and type(value) is not str:
            raise BadFrame(f"tool_call.{key} must be a string or nil")
    return data


def parse_delta(obj: Any) -> Delta:
    """`[T_DELTA, call_id, attempt, seq, kind, data]` (the sink's `_take` checks
    the same inline)."""
    if not _is_tag(obj, T_DELTA, 6):
        raise BadFrame("not a T_DELTA array of 6 elements")
    _, call_id, attempt, seq, kind, data = obj
    if type(call_id) is not str or type(attempt) is not int or type(seq) is not int:
        raise BadFrame("T_DELTA's call_id must be a string, its attempt and seq integers")
    if type(kind) is not str or kind not in KINDS:
        raise BadFrame(f"unknown delta kind {str(kind)[:40]!r}")
    if kind == TOOL_CALL:
        check_tool_fragment(data)
    elif type(data) is not str:
        raise BadFrame(f"{kind} data must be a string")
    return Delta(call_id, attempt, seq, kind, data)


# ---- T_FINAL -----------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Final:
    call_id: str
    attempt: int
    last_seq: int
    outcome: AttemptOutcome


def final_frame(call_id: str, attempt: int, last_seq: int, outcome: list[Any]) -> bytes:
    """`outcome`: `outcome_to_wire(AttemptOutcome)`."""
    frame: bytes = _pack([T_FINAL, call_id, attempt, last_seq, outcome])
    return frame


def parse_final(obj: Any) -> Final:
    """`[T_FINAL, call_id, attempt, last_seq, outcome_to_wire(outcome)]`; its
    outcome is parsed once, here (a bad outcome is a bad frame)."""
    if not _is_tag(obj, T_FINAL, 5):
        raise BadFrame("not a T_FINAL array of 5 elements")
    try:
        outcome = outcome_from_wire(obj[4])
    except BadOutcome as exc:
        raise BadFrame(str(exc)) from None
    return Final(check_call_id(obj[1]), check_int(obj[2], "attempt", 1),
                 check_int(obj[3], "last_seq", 0), outcome)


# ---- T_HELLO -----------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Hello:
    """A worker's first message on a connection opened again mid-attempt."""

    call_id: str
    attempt: int
    token: int


def hello_frame(call_id: str, attempt: int, token: int) -> bytes:
    frame: bytes = _pack([T_HELLO, call_id, attempt, token])
    return frame


def parse_hello(obj: Any) -> Hello:
    """`[T_HELLO, call_id, attempt, token]`."""
    if not _is_tag(obj, T_HELLO, 4):
        raise BadFrame("not a T_HELLO array of 4 elements")
    return Hello(check_call_id(obj[1]), check_int(obj[2], "attempt", 1),
                 check_int(obj[3], "token", 0))


# ---- sink -> worker: T_FINAL_ACK, T_REBIND -----------------------------------------

@dataclass(frozen=True, slots=True)
class FinalAck:
    call_id: str
    attempt: int
    accepted: bool
    reason: str


@dataclass(frozen=True, slots=True)
class RebindTo:
    """The answer to a Hello: go on as `new_attempt` after `resume_after` (0: over)."""

    call_id: str
    attempt: int
    new_attempt: int
    resume_after: int


def final_ack_frame(final: Final, accepted: bool, reason: str = "") -> bytes:
    """The answer to `final`."""
    frame: bytes = _pack([T_FINAL_ACK, final.call_id, final.attempt, accepted, reason])
    return frame


def rebind_frame(hello: Hello, new_attempt: int, resume_after: int) -> bytes:
    """The answer to `hello`: write on as `new_attempt` after seq `resume_after`
    (0: the attempt is over)."""
    frame: bytes = _pack([T_REBIND, hello.call_id, hello.attempt, new_attempt, resume_after])
    return frame


def parse_sink_reply(obj: Any) -> FinalAck | RebindTo:
    """What the sink writes back to a worker: `[T_FINAL_ACK, call_id, attempt,
    accepted, reason]` or `[T_REBIND, call_id, attempt, new_attempt, resume_after]`."""
    if _is_tag(obj, T_FINAL_ACK, 5):
        if type(obj[3]) is not bool or type(obj[4]) is not str:
            raise BadFrame("T_FINAL_ACK's accepted must be a boolean, its reason a string")
        return FinalAck(check_call_id(obj[1]), check_int(obj[2], "attempt", 1), obj[3], obj[4])
    if _is_tag(obj, T_REBIND, 5):
        return RebindTo(check_call_id(obj[1]), check_int(obj[2], "attempt", 1),
                        check_int(obj[3], "new_attempt", 0), check_int(obj[4], "resume_after", 0))
    raise BadFrame("not a T_FINAL_ACK or T_REBIND array of 5 elements")
