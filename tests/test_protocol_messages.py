"""streamfence.protocol.messages: parse_request for every op and every way to get it
wrong, parse_listener_msg (the events socket), and the events endpoint's address."""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamfence.protocol.codec import decode_untrusted, encode
from streamfence.protocol.errors import ErrorCode, ProtocolError
from streamfence.protocol.fields import MAX_REF_LEN
from streamfence.protocol.messages import (
    LISTENER_RE,
    VERSION,
    CallOptions,
    CallSpec,
    CallStatus,
    Cancel,
    OnPartial,
    Op,
    Result,
    Status,
    Submit,
    Subscribe,
    accepted_msg,
    delta_event,
    done_event,
    empty_response,
    error_msg,
    events_endpoint,
    listening_msg,
    parse_listener_msg,
    parse_request,
    pending_msg,
    ref_of,
    reset_event,
)

REQUEST = {"model": "gpt-x", "messages": [{"role": "user", "content": "hi"}]}
LISTENER = "0123456789abcdef0123456789abcdef"  # a uuid4 hex, as the library makes them


def submit(**call: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"provider": "openai", "request": dict(REQUEST)}
    body.update(call)
    return {"v": 1, "op": "submit", "ref": "r1", "call": body}


VALID: dict[str, dict[str, Any]] = {
    "submit": submit(),
    "subscribe": {"v": 1, "op": "subscribe", "ref": "r2", "call_id": "c1", "listener": LISTENER},
    "result": {"v": 1, "op": "result", "ref": "r3", "call_id": "c1"},
    "cancel": {"v": 1, "op": "cancel", "ref": "r4", "call_id": "c1"},
    "status": {"v": 1, "op": "status", "ref": "r5"},
}


def refused(obj: Any, code: ErrorCode = ErrorCode.BAD_MESSAGE) -> str:
    with pytest.raises(ProtocolError) as info:
        parse_request(obj)
    assert info.value.code is code
    return info.value.message


def with_field(msg: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A deep copy of `msg` with the dotted `path` set to `value` (or deleted if ...)."""
    out = copy.deepcopy(msg)
    *parents, last = path.split(".")
    node = out
    for p in parents:
        node = node.setdefault(p, {})
    if value is ...:
        node.pop(last, None)
    else:
        node[last] = value
    return out


# ---- valid requests ---------------------------------------------------------------

def test_submit_minimal_gets_the_defaults() -> None:
    assert parse_request(submit()) == Submit(
        ref="r1", call=CallSpec(provider="openai", request=REQUEST), listener=None)
    assert parse_request(submit()).call.options == CallOptions()  # type: ignore[union-attr]


def test_submit_with_every_field() -> None:
    msg = submit(session_id="s1", idempotency_key="k1",
                 options={"stale_timeout_s": 30, "first_chunk_timeout_s": 600.5,
                          "max_attempts": 5, "deadline_s": 900, "on_partial": "restart"})
    msg["subscribe"] = True
    msg["listener"] = LISTENER
    req = parse_request(msg)
    assert req == Submit(ref="r1", listener=LISTENER, call=CallSpec(
        provider="openai", request=REQUEST, session_id="s1", idempotency_key="k1",
        options=CallOptions(stale_timeout_s=30.0, first_chunk_timeout_s=600.5, max_attempts=5,
                            deadline_s=900.0, on_partial=OnPartial.RESTART)))
    assert isinstance(req, Submit)
    assert isinstance(req.call.options.stale_timeout_s, float)


def test_submit_nil_optionals_mean_absent() -> None:
    msg = submit(session_id=None, idempotency_key=None, options=None)
    msg["subscribe"] = None
    msg["listener"] = None
    req = parse_request(msg)
    assert isinstance(req, Submit)
    assert req.listener is None and req.call.session_id is None
    assert req.call.options == CallOptions()


# ---- who receives a call's events: the listener ---------------------------------------

@pytest.mark.parametrize(("subscribe", "listener", "expect"), [
    (..., LISTENER, LISTENER),  # a listener alone subscribes it
    (True, LISTENER, LISTENER),
    (False, LISTENER, None),  # subscribe false: nobody, even with a listener
    (False, ..., None),
    (..., ..., None),  # neither: nobody
    (None, ..., None),
], ids=["listener-only", "subscribe-true", "subscribe-false", "false-alone", "neither",
        "nil-subscribe"])
def test_submit_listener_and_subscribe(subscribe: Any, listener: Any, expect: str | None) -> None:
    msg = with_field(with_field(submit(), "subscribe", subscribe), "listener", listener)
    req = parse_request(msg)
    assert isinstance(req, Submit) and req.listener == expect


@pytest.mark.parametrize("listener", [..., None], ids=["absent", "nil"])
def test_submit_subscribe_true_needs_a_listener(listener: Any) -> None:
    msg = with_field(with_field(submit(), "subscribe", True), "listener", listener)
    assert refused(msg) == "field 'listener' is missing"


@pytest.mark.parametrize("listener", [
    "a" * 16, "Z" * 64, "abc-DEF_0123456789", LISTENER,
], ids=["16", "64", "every-class", "uuid-hex"])
def test_listener_ids_that_pass(listener: str) -> None:
    req = parse_request({**submit(), "listener": listener})
    assert isinstance(req, Submit) and req.listener == listener
    sub = parse_request({**VALID["subscribe"], "listener": listener})
    assert isinstance(sub, Subscribe) and sub.listener == listener
    assert LISTENER_RE.fullmatch(listener)


BAD_LISTENERS: list[tuple[Any, str]] = [
    ("a" * 15, "must be 16 to 64 characters"),
    ("a" * 65, "must be 16 to 64 characters"),
    ("", "must be 16 to 64 characters"),
    ("0123456789abcde!", "from A-Z a-z 0-9 _ -"),
    ("0123456789abcdef\n", "must be 16 to 64 characters"),  # fullmatch: no trailing newline
    ("0123456789 abcdef", "must be 16 to 64 characters"),
    ("0123456789abcdeé", "must be 16 to 64 characters"),
    (b"0123456789abcdef", "must be a string, got bytes"),
    (12345678901234567, "must be a string, got int"),
]


@pytest.mark.parametrize("op", ["submit", "subscribe"])
@pytest.mark.parametrize(("listener", "why"), BAD_LISTENERS,
                         ids=[repr(v)[:24] for v, _ in BAD_LISTENERS])
def test_invalid_listener_is_refused(op: str, listener: Any, why: str) -> None:
    message = refused({**VALID[op], "listener": listener})
    assert message.startswith("field 'listener' ") and why in message


def test_options_to_map_round_trips_through_the_parser() -> None:
    opts = CallOptions(stale_timeout_s=12.0, max_attempts=2, on_partial=OnPartial.RESTART)
    req = parse_request(submit(options=opts.to_map()))
    assert isinstance(req, Submit) and req.call.options == opts


def test_subscribe_result_cancel_status() -> None:
    assert parse_request(VALID["subscribe"]) == Subscribe(ref="r2", call_id="c1",
                                                          listener=LISTENER, from_seq=0)
    assert parse_request({**VALID["subscribe"], "from_seq": 7}) == Subscribe("r2", "c1",
                                                                             LISTENER, 7)
    assert parse_request(VALID["result"]) == Result(ref="r3", call_id="c1", wait_s=0.0)
    res = parse_request({**VALID["result"], "wait_s": 3})
    assert isinstance(res, Result) and res == Result("r3", "c1", 3.0)
    assert isinstance(res.wait_s, float)
    assert parse_request({**VALID["result"], "wait_s": 3600}) == Result("r3", "c1", 3600.0)
    assert parse_request(VALID["cancel"]) == Cancel(ref="r4", call_id="c1")
    assert parse_request(VALID["status"]) == Status(ref="r5")


def test_requests_survive_the_codec() -> None:
    for msg in VALID.values():
        assert parse_request(decode_untrusted(encode(msg))) == parse_request(msg)


def test_unknown_top_level_fields_are_ignored() -> None:
    assert parse_request({**VALID["status"], "extra": [1, 2]}) == Status(ref="r5")


def test_ref_of_max_length_is_accepted() -> None:
    assert parse_request({**VALID["status"], "ref": "r" * MAX_REF_LEN}) == Status("r" * MAX_REF_LEN)
    assert parse_request({**VALID["status"], "ref": ""}) == Status("")


# ---- the envelope ------------------------------------------------------------------

@pytest.mark.parametrize("obj", [[1, "submit"], "submit", None, 1, b"\x81", 1.5, True])
def test_not_a_map(obj: Any) -> None:
    assert refused(obj) == f"a message must be a map, got {type(obj).__name__}"


def test_missing_v() -> None:
    msg = dict(VALID["status"])
    del msg["v"]
    assert refused(msg) == "field 'v' is missing"


@pytest.mark.parametrize("v", [0, 2, -1, "1", b"1", None, [1], True, False, 1.5])
def test_wrong_v(v: Any) -> None:
    message = refused({**VALID["status"], "v": v}, ErrorCode.UNSUPPORTED_VERSION)
    assert f"protocol version {v!r} is not supported" in message
    assert f"v{VERSION}" in message


def test_missing_op() -> None:
    msg = dict(VALID["status"])
    del msg["op"]
    assert refused(msg) == "field 'op' is missing"


@pytest.mark.parametrize("op", [5, True, None, ["status"], b"status"])
def test_op_of_wrong_type(op: Any) -> None:
    message = refused({**VALID["status"], "op": op})
    assert "'op'" in message


@pytest.mark.parametrize("op", ["frobnicate", "", "STATUS", "accepted", "done", "delta", "error"])
def test_unknown_op(op: str) -> None:
    assert refused({**VALID["status"], "op": op}, ErrorCode.UNKNOWN_OP) == f"unknown op {op!r}"


def test_version_is_checked_before_op() -> None:
    refused({"v": 2, "op": "frobnicate"}, ErrorCode.UNSUPPORTED_VERSION)


# ---- each field missing or mistyped, named in the message --------------------------

MISSING = [
    ("submit", "ref"), ("submit", "call"), ("submit", "call.provider"),
    ("submit", "call.request"), ("subscribe", "ref"), ("subscribe", "call_id"),
    ("subscribe", "listener"),
    ("result", "ref"), ("result", "call_id"), ("cancel", "ref"), ("cancel", "call_id"),
    ("status", "ref"),
]


@pytest.mark.parametrize(("op", "path"), MISSING, ids=[f"{o}-{p}" for o, p in MISSING])
@pytest.mark.parametrize("how", ["absent", "nil"])
def test_required_field_missing(op: str, path: str, how: str) -> None:
    msg = with_field(VALID[op], path, ... if how == "absent" else None)
    assert refused(msg) == f"field {path!r} is missing"


MISTYPED: list[tuple[str, str, Any, str]] = [
    ("submit", "ref", 5, "must be a string, got int"),
    ("submit", "ref", b"r1", "must be a string, got bytes"),
    ("submit", "call", [], "must be a map, got list"),
    ("submit", "call", "x", "must be a map, got str"),
    ("submit", "call.provider", 1, "must be a string, got int"),
    ("submit", "call.provider", "", "must not be empty"),
    ("submit", "call.request", [], "must be a map, got list"),
    ("submit", "call.request", "hi", "must be a map, got str"),
    ("submit", "call.session_id", 7, "must be a string, got int"),
    ("submit", "call.idempotency_key", True, "must be a string, got bool"),
    ("submit", "call.session_id", "s" * (MAX_REF_LEN + 1), f"longer than {MAX_REF_LEN}"),
    ("submit", "call.idempotency_key", "k" * (MAX_REF_LEN + 1), f"longer than {MAX_REF_LEN}"),
    ("submit", "call.options", [], "must be a map, got list"),
    ("submit", "subscribe", 1, "must be a boolean, got int"),
    ("submit", "subscribe", "yes", "must be a boolean, got str"),
    ("subscribe", "call_id", 1, "must be a string, got int"),
    ("subscribe", "from_seq", "3", "must be an integer, got str"),
    ("subscribe", "from_seq", 1.5, "must be an integer, got float"),
    ("subscribe", "from_seq", True, "got bool"),
    ("subscribe", "from_seq", -1, "must not be negative"),
    ("subscribe", "listener", 5, "must be a string, got int"),
    ("subscribe", "listener", "short", "must be 16 to 64 characters from A-Z a-z 0-9 _ -"),
    ("submit", "listener", ["x"], "must be a string, got list"),
    ("submit", "listener", "x/" * 10, "must be 16 to 64 characters from A-Z a-z 0-9 _ -"),
    ("result", "call_id", ["c1"], "must be a string, got list"),
    ("result", "wait_s", "1", "got str"),
    ("result", "wait_s", True, "got bool"),
    ("result", "wait_s", -0.5, "must be between 0 and 3600"),
    ("result", "wait_s", 3600.5, "must be between 0 and 3600"),
    ("result", "wait_s", math.nan, "must be between 0 and 3600"),
    ("result", "wait_s", math.inf, "must be between 0 and 3600"),
    ("cancel", "call_id", {"id": 1}, "must be a string, got dict"),
    ("status", "ref", 1.0, "must be a string, got float"),
]


@pytest.mark.parametrize(("op", "path", "value", "why"), MISTYPED,
                         ids=[f"{o}-{p}-{v!r}"[:40] for o, p, v, _ in MISTYPED])
def test_field_mistyped(op: str, path: str, value: Any, why: str) -> None:
    message = refused(with_field(VALID[op], path, value))
    assert message.startswith(f"field {path!r} ")
    assert why in message


@pytest.mark.parametrize("op", list(VALID))
def test_over_long_ref(op: str) -> None:
    message = refused({**VALID[op], "ref": "r" * (MAX_REF_LEN + 1)})
    assert message == f"field 'ref' is longer than {MAX_REF_LEN} characters"


def test_stream_in_request_is_refused() -> None:
    for value in (True, False, None):
        message = refused(with_field(submit(), "call.request.stream", value))
        assert message.startswith("field 'call.request.stream' must not be set")


def test_request_with_non_string_keys_is_refused() -> None:
    msg = submit()
    msg["call"]["request"] = {1: "x"}
    assert refused(msg) == "field 'call.request' must have string keys"


# ---- call options ----------------------------------------------------------------

OPTION_ERRORS: list[tuple[str, Any, str]] = [
    ("stale_timeout_s", 0, "must be a positive number of seconds"),
    ("stale_timeout_s", -1.0, "must be a positive number of seconds"),
    ("stale_timeout_s", 1e7, "must be a positive number of seconds"),
    ("stale_timeout_s", math.nan, "must be a positive number of seconds"),
    ("stale_timeout_s", math.inf, "must be a positive number of seconds"),
    ("stale_timeout_s", "30", "got str"),
    ("stale_timeout_s", True, "got bool"),
    ("first_chunk_timeout_s", 0.0, "must be a positive number of seconds"),
    ("first_chunk_timeout_s", [1], "got list"),
    ("deadline_s", -5, "must be a positive number of seconds"),
    ("deadline_s", False, "got bool"),
    ("max_attempts", 0, "must be between 1 and 100"),
    ("max_attempts", 101, "must be between 1 and 100"),
    ("max_attempts", 1.5, "must be an integer, got float"),
    ("max_attempts", True, "got bool"),
    ("on_partial", "sometimes", 'must be "continue" or "restart"'),
    ("on_partial", 1, "must be a string, got int"),
    ("retries", 3, "is not a known option"),
]


@pytest.mark.parametrize(("name", "value", "why"), OPTION_ERRORS,
                         ids=[f"{n}-{v!r}" for n, v, _ in OPTION_ERRORS])
def test_option_out_of_range_or_mistyped(name: str, value: Any, why: str) -> None:
    message = refused(submit(options={name: value}))
    assert message.startswith(f"field 'call.options.{name}' ")
    assert why in message


@pytest.mark.parametrize(("name", "value"), [
    ("stale_timeout_s", 0.001), ("stale_timeout_s", 9_999_999), ("max_attempts", 1),
    ("max_attempts", 100), ("deadline_s", 1), ("on_partial", "continue"),
])
def test_option_limits_that_pass(name: str, value: Any) -> None:
    req = parse_request(submit(options={name: value}))
    assert isinstance(req, Submit)
    assert getattr(req.call.options, name) == value


# ---- replies and events built for clients -----------------------------------------

def test_reply_and_event_builders_carry_v_and_op() -> None:
    built = [
        error_msg("r", ErrorCode.UNKNOWN_CALL, "no such call"),
        accepted_msg("r", "c1", duplicate=True), pending_msg("r", "c1"),
        delta_event("c1", 2, 5, "text", "hi"), reset_event("c1", 3, 6),
        done_event("c1", 7, CallStatus.COMPLETED, empty_response(), None, 3),
    ]
    for msg in built:
        assert msg["v"] == VERSION
        assert decode_untrusted(encode(msg)) == msg
        refused(msg, ErrorCode.UNKNOWN_OP)  # a reply is never mistaken for a request
    assert built[0] == {"v": 1, "op": "error", "ref": "r", "code": "unknown_call",
                        "message": "no such call"}
    assert built[1]["duplicate"] is True
    assert built[5]["op"] == Op.DONE and built[5]["seq"] == 7 and built[5]["status"] == "completed"


# ---- the events socket: `listen`, and where it is ------------------------------------

def test_parse_listener_msg_takes_listen_and_ack() -> None:
    assert parse_listener_msg({"v": 1, "op": "listen"}) is None
    assert parse_listener_msg({"v": 1, "op": "listen", "extra": 1}) is None  # unknown: ignored
    assert parse_listener_msg({"v": 1, "op": "ack", "read": 0}) == 0
    assert parse_listener_msg({"v": 1, "op": "ack", "read": 1 << 40}) == 1 << 40
    assert listening_msg() == {"v": 1, "op": "listening"}
    assert decode_untrusted(encode(listening_msg())) == listening_msg()
    # on the client endpoint `listen` is not a request, and `listening` is a reply
    assert refused({"v": 1, "op": "listen", "ref": "r"}, ErrorCode.UNKNOWN_OP) == \
        "unknown op 'listen'"
    refused({**listening_msg(), "ref": "r"}, ErrorCode.UNKNOWN_OP)


@pytest.mark.parametrize(("obj", "code", "why"), [
    ([1, "listen"], ErrorCode.BAD_MESSAGE, "a message must be a map, got list"),
    (None, ErrorCode.BAD_MESSAGE, "a message must be a map, got NoneType"),
    ({"op": "listen"}, ErrorCode.UNSUPPORTED_VERSION, "protocol version None is not supported"),
    ({"v": 2, "op": "listen"}, ErrorCode.UNSUPPORTED_VERSION, "protocol version 2"),
    ({"v": True, "op": "listen"}, ErrorCode.UNSUPPORTED_VERSION, "protocol version True"),
    ({"v": 1}, ErrorCode.UNKNOWN_OP, "the events socket takes only 'listen' and 'ack', got None"),
    ({"v": 1, "op": "ack"}, ErrorCode.BAD_MESSAGE, "field 'read' is missing"),
    ({"v": 1, "op": "ack", "read": -1}, ErrorCode.BAD_MESSAGE, "field 'read' must be at least 0"),
    ({"v": 1, "op": "ack", "read": True}, ErrorCode.BAD_MESSAGE, "got bool"),
    ({"v": 1, "op": "ack", "read": 1.5}, ErrorCode.BAD_MESSAGE, "must be an integer"),
    ({"v": 1, "op": "submit", "ref": "r"}, ErrorCode.UNKNOWN_OP,
     "got 'submit'; requests go to the client endpoint"),
    ({"v": 1, "op": "LISTEN"}, ErrorCode.UNKNOWN_OP, "got 'LISTEN'"),
    ({"v": 1, "op": b"listen"}, ErrorCode.UNKNOWN_OP, "got b'listen'"),
], ids=["list", "nil", "no-v", "v2", "v-true", "no-op", "ack-no-read", "ack-negative",
        "ack-bool", "ack-float", "submit", "upper", "bytes"])
def test_parse_listen_refuses_anything_else(obj: Any, code: ErrorCode, why: str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_listener_msg(obj)
    assert info.value.code is code and why in info.value.message


@pytest.mark.parametrize(("endpoint", "events"), [
    ("tcp://127.0.0.1:7755", "tcp://127.0.0.1:7756"),
    ("tcp://*:7755", "tcp://*:7756"),
    ("tcp://[::1]:9", "tcp://[::1]:10"),
    ("tcp://daemon.example:65534", "tcp://daemon.example:65535"),
    ("tcp://h:1", "tcp://h:2"),
    ("ipc:///run/streamfence/d.sock", "ipc:///run/streamfence/d.sock.events"),
    ("ipc://@abstract", "ipc://@abstract.events"),
])
def test_events_endpoint(endpoint: str, events: str) -> None:
    assert events_endpoint(endpoint) == events


@pytest.mark.parametrize("endpoint", [
    "tcp://127.0.0.1:65535",  # no port above it
    "tcp://127.0.0.1:0", "tcp://127.0.0.1", "tcp://127.0.0.1:", "tcp://h:port",
    "tcp://h:-1", "inproc://x", "udp://h:7755", "127.0.0.1:7755", "",
])
def test_events_endpoint_of_anything_else_is_a_value_error(endpoint: str) -> None:
    with pytest.raises(ValueError, match=r"neither tcp://HOST:PORT .* nor ipc://PATH"):
        events_endpoint(endpoint)


def test_empty_response_has_every_normalized_field() -> None:
    assert set(empty_response()) == {"content", "reasoning", "tool_calls", "refusal",
                                     "finish_reason", "usage", "model", "provider_response_id",
                                     "partial", "dropped_tool_names", "content_omitted"}


@pytest.mark.parametrize(("obj", "ref"), [
    ({"ref": "abc"}, "abc"), ({"ref": 5}, None), ({"ref": "r" * (MAX_REF_LEN + 1)}, None),
    ([1], None), ({}, None),
])
def test_ref_of(obj: Any, ref: str | None) -> None:
    assert ref_of(obj) == ref


# ---- property tests ------------------------------------------------------------------

scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
           | st.floats() | st.text(max_size=20) | st.binary(max_size=8))
values = st.recursive(scalars, lambda c: st.lists(c, max_size=4)
                      | st.dictionaries(st.text(max_size=10), c, max_size=4), max_leaves=12)
keys = st.sampled_from(["v", "op", "ref", "call", "call_id", "from_seq", "wait_s", "subscribe",
                        "listener",
                        "provider", "request", "options", "stream", "session_id",
                        "idempotency_key", "stale_timeout_s", "max_attempts", "on_partial",
                        "deadline_s", "first_chunk_timeout_s"]) | st.text(max_size=6)


@pytest.mark.slow
@settings(max_examples=400)
@given(st.dictionaries(keys | st.integers() | st.binary(max_size=4), values, max_size=8))
def test_arbitrary_maps_raise_only_protocol_error(obj: dict[Any, Any]) -> None:
    with contextlib.suppress(ProtocolError):
        parse_request(obj)


PATHS = ["v", "op", "ref", "call", "call.provider", "call.request", "call.request.stream",
         "call.session_id", "call.idempotency_key", "call.options",
         "call.options.stale_timeout_s", "call.options.first_chunk_timeout_s",
         "call.options.max_attempts", "call.options.deadline_s", "call.options.on_partial",
         "call.options.x", "subscribe", "listener", "call_id", "from_seq", "wait_s"]


@pytest.mark.slow
@settings(max_examples=600)
@given(st.sampled_from(list(VALID)), st.lists(st.tuples(st.sampled_from(PATHS), values),
                                             max_size=3))
def test_mutated_valid_messages_raise_only_protocol_error(op: str,
                                                          edits: list[tuple[str, Any]]) -> None:
    msg = copy.deepcopy(VALID[op])
    msg["call"] = dict(submit()["call"], options={})
    for path, value in edits:
        try:
            msg = with_field(msg, path, value)
        except (AttributeError, TypeError):  # a parent was replaced by a non-map
            continue
    with contextlib.suppress(ProtocolError):
        parse_request(msg)


@given(st.binary(max_size=200))
def test_decode_then_parse_raises_only_protocol_error(frame: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        parse_request(decode_untrusted(frame))
