"""The worker wire (streamfence.protocol.internal.worker_wire) and the supervisor
<-> worker messages (streamfence.protocol.internal.workers): every message
survives its builder then its parser, and garbage raises only BadFrame."""

from __future__ import annotations

import contextlib
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from streamfence.protocol.codec import decode_untrusted
from streamfence.protocol.errors import ProtocolError
from streamfence.protocol.internal.checks import BadFrame
from streamfence.protocol.internal.outcome import (
    AttemptDiag,
    AttemptError,
    AttemptOutcome,
    ErrorClass,
    outcome_to_wire,
)
from streamfence.protocol.internal.worker_wire import (
    KINDS,
    MAX_TOOL_INDEX,
    TOOL_CALL,
    Delta,
    Final,
    FinalAck,
    Hello,
    RebindTo,
    delta_frame,
    final_ack_frame,
    final_frame,
    hello_frame,
    parse_delta,
    parse_final,
    parse_hello,
    parse_sink_reply,
    rebind_frame,
)
from streamfence.protocol.internal.workers import (
    AttemptSettings,
    RunAttempt,
    WorkerHello,
    WorkerIdle,
    encode_run,
    idle_frame,
    parse_from_worker,
    parse_run,
    worker_hello_frame,
)
from tests.test_sink_robustness import GARBAGE_IN

call_ids = st.text(min_size=1, max_size=256)
attempts = st.integers(min_value=1, max_value=2**31)
counts = st.integers(min_value=0, max_value=2**40)
text_kinds = st.sampled_from(sorted(KINDS - {TOOL_CALL}))
fragments = st.fixed_dictionaries(
    {"index": st.integers(0, MAX_TOOL_INDEX)},
    optional={"id": st.none() | st.text(), "name": st.none() | st.text(),
              "arguments": st.none() | st.text()})
deltas = st.one_of(
    st.builds(Delta, call_ids, attempts, counts, text_kinds, st.text()),
    st.builds(Delta, call_ids, attempts, counts, st.just(TOOL_CALL), fragments))
outcomes = st.builds(
    AttemptOutcome, st.booleans(), st.none() | st.text(), st.none() | st.just({"total": 3}),
    st.none() | st.text(), st.none() | st.text(), st.lists(st.text()).map(tuple),
    st.lists(st.integers(0, 99)).map(tuple),
    st.none() | st.builds(AttemptError, st.sampled_from(ErrorClass), st.text(), st.text()),
    st.builds(AttemptDiag, st.none() | st.floats(0, 1e6), st.integers(0, 99)))


def wire(frame: bytes) -> Any:
    """What the other end's unpacker makes of `frame`."""
    return decode_untrusted(frame)


@given(deltas)
def test_delta_round_trip(d: Delta) -> None:
    assert parse_delta(wire(delta_frame(d.call_id, d.attempt, d.seq, d.kind, d.data))) == d


@given(call_ids, attempts, counts, outcomes)
def test_final_round_trip(call_id: str, attempt: int, last_seq: int,
                          outcome: AttemptOutcome) -> None:
    frame = final_frame(call_id, attempt, last_seq, outcome_to_wire(outcome))
    assert parse_final(wire(frame)) == Final(call_id, attempt, last_seq, outcome)


@given(st.builds(Hello, call_ids, attempts, counts))
def test_hello_round_trip(hello: Hello) -> None:
    assert parse_hello(wire(hello_frame(hello.call_id, hello.attempt, hello.token))) == hello


@given(call_ids, attempts, st.booleans(), st.text())
def test_final_ack_round_trip(call_id: str, attempt: int, accepted: bool, reason: str) -> None:
    final = Final(call_id, attempt, 0, AttemptOutcome(ok=True))
    assert parse_sink_reply(wire(final_ack_frame(final, accepted, reason))) == FinalAck(
        call_id, attempt, accepted, reason)


@given(st.builds(Hello, call_ids, attempts, counts), counts, counts)
def test_rebind_round_trip(hello: Hello, new_attempt: int, after: int) -> None:
    assert parse_sink_reply(wire(rebind_frame(hello, new_attempt, after))) == RebindTo(
        hello.call_id, hello.attempt, new_attempt, after)


@given(st.integers(0, 2**31), st.integers(1, 2**22))
def test_worker_hello_round_trip(worker_id: int, pid: int) -> None:
    assert parse_from_worker(worker_hello_frame(worker_id, pid)) == WorkerHello(worker_id, pid)


@given(st.integers(0, 2**31), counts, st.booleans())
def test_idle_round_trip(worker_id: int, token: int, accepted: bool) -> None:
    assert parse_from_worker(idle_frame(worker_id, token, accepted)) == WorkerIdle(
        worker_id, token, accepted)


@given(st.builds(RunAttempt, counts, call_ids, attempts, st.none() | st.text(),
                 st.just({"name": "p", "base_url": "http://x"}),
                 st.just({"model": "m", "messages": []}),
                 st.builds(AttemptSettings, st.booleans(), st.booleans(),
                           notice=st.none() | st.text()),
                 st.none() | st.text()))
def test_run_round_trip(run: RunAttempt) -> None:
    assert parse_run(encode_run(run)) == run


WORKER_PARSERS = [parse_delta, parse_final, parse_hello, parse_sink_reply]


scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text()
           | st.binary())


@given(st.recursive(scalars, lambda inner: st.lists(inner, max_size=7)
                    | st.dictionaries(st.text(), inner, max_size=4), max_leaves=20))
def test_garbage_raises_only_bad_frame(obj: Any) -> None:
    frame = msgpack.packb(obj, use_bin_type=True)
    for parse in WORKER_PARSERS:
        with contextlib.suppress(BadFrame):
            parse(obj)
    for parse_bytes in (parse_from_worker, parse_run):
        for data in (frame, frame[:-1], b"\xc1" + frame):
            with contextlib.suppress(BadFrame):
                parse_bytes(data)


@pytest.mark.parametrize("msg", [
    [0, "c", 1, 1, "text"], [0, "c", 1, 1, "text", "x", 1], [True, "c", 1, 1, "text", "x"],
    [0, "", 1, 1, "text", "x"][1:], [0, "c", 1, 1, ["text"], "x"],
    [0, "c", 1, 1, "tool_call", {"index": MAX_TOOL_INDEX + 1}],
])
def test_bad_deltas_are_refused(msg: Any) -> None:
    with pytest.raises(BadFrame):
        parse_delta(msg)


@pytest.mark.parametrize("parts", [p for p in GARBAGE_IN if len(p) == 1],
                         ids=lambda parts: parts[0][:12].hex())
def test_what_the_sink_refuses_every_worker_wire_parser_refuses(parts: list[bytes]) -> None:
    """The sink checks T_DELTA inline (sink/intake.py `_take`); these are the
    frames tests/test_sink_robustness.py sees it count as bad."""
    try:
        msg = decode_untrusted(parts[0])
    except ProtocolError:
        return  # refused before any parser
    for parse in WORKER_PARSERS:
        with pytest.raises(BadFrame):
            parse(msg)


@pytest.mark.parametrize("frame", [b"", b"\xc1", msgpack.packb([41]), msgpack.packb([42, 1]),
                                   msgpack.packb([43, 1, 2, 1]), msgpack.packb([40, 1])])
def test_bad_supervisor_worker_frames_are_refused(frame: bytes) -> None:
    for parse in (parse_from_worker, parse_run):
        with pytest.raises(BadFrame):
            parse(frame)
