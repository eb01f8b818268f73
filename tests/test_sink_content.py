"""Response assembly (streamfence.sink.content), the sink's pre-encoded event pieces
(streamfence.sink.event_pieces) and the shape checks of the messages it is sent."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from streamfence.protocol.codec import encode
from streamfence.protocol.internal import C_AUTHORIZE, C_FENCE, C_FINISH, C_STATS, C_SUBSCRIBE
from streamfence.protocol.internal.checks import BadFrame
from streamfence.protocol.internal.control import (
    FROM_NOW,
    AddSubscriber,
    Authorize,
    Fence,
    Finish,
    FinishMeta,
    ListenerOwner,
    Stats,
    encode_control,
    meta_from_wire,
    parse_control,
)
from streamfence.protocol.internal.outcome import AttemptOutcome, outcome_to_wire
from streamfence.protocol.internal.worker_wire import check_tool_fragment, parse_final
from streamfence.protocol.messages import CallStatus, DeltaKind, delta_event, empty_response
from streamfence.sink.content import Content
from streamfence.sink.event_pieces import KIND_TAIL, delta_prefix

OK = outcome_to_wire(AttemptOutcome(ok=True, finish_reason="stop"))
LISTENER = "l-" + "0123456789abcdef" * 2  # a listener id: 16-64 of [A-Za-z0-9_-]
OWNER = ListenerOwner("a")  # whose share a subscription uses
W_OWNER = ["a", 0, 0]  # ... on the wire


def feed(content: Content, deltas: list[tuple[str, Any]]) -> None:
    for kind, data in deltas:
        if kind == "tool_call":
            check_tool_fragment(data)
        content.add[kind](data)


def test_text_reasoning_refusal_are_joined() -> None:
    c = Content()
    feed(c, [("reasoning", "think "), ("text", "Hel"), ("reasoning", "more"), ("text", "lo"),
             ("notice", "reconnected"), ("refusal", "I can"), ("refusal", "not")])
    r = c.build_response(meta_from_wire({"finish_reason": "stop", "model": "m1"}))
    assert r["content"] == "Hello"
    assert r["reasoning"] == "think more"
    assert r["refusal"] == "I cannot"
    assert r["finish_reason"] == "stop" and r["model"] == "m1"
    assert "reconnected" not in repr(r)  # notices are not content


def test_empty_content_gives_the_full_empty_shape() -> None:
    r = Content().build_response(FinishMeta())
    assert r == empty_response()
    assert set(r) == set(empty_response())


def test_tool_call_fragments_assemble_by_slot() -> None:
    c = Content()
    feed(c, [
        ("tool_call", {"index": 0, "id": "call_a", "name": "get_weather", "arguments": ""}),
        ("tool_call", {"index": 1, "id": "call_b", "name": "get_time", "arguments": "{\"tz\""}),
        ("tool_call", {"index": 0, "arguments": "{\"city\": "}),
        ("tool_call", {"index": 0, "id": None, "name": None, "arguments": "\"Paris\"}"}),
        ("tool_call", {"index": 1, "name": "ignored_later_name", "arguments": ": \"UTC\"}"}),
    ])
    r = c.build_response(meta_from_wire({}))
    assert r["tool_calls"] == [
        {"id": "call_a", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
        {"id": "call_b", "name": "get_time", "arguments": "{\"tz\": \"UTC\"}"},
    ]
    assert c.tool_fragments() == 5


def test_tool_call_name_arriving_late_is_assigned_once() -> None:
    c = Content()
    feed(c, [("tool_call", {"index": 2, "arguments": "{}"}),
             ("tool_call", {"index": 2, "id": "x", "name": "f"}),
             ("tool_call", {"index": 2, "name": "g"})])
    assert c.tool_calls() == [{"id": "x", "name": "f", "arguments": "{}"}]


def test_dropped_tool_indexes_and_names() -> None:
    c = Content()
    feed(c, [("tool_call", {"index": 0, "id": "a", "name": "f", "arguments": "{}"}),
             ("tool_call", {"index": 1, "id": "b", "name": "g", "arguments": "{\"trunc"})])
    r = c.build_response(FinishMeta(finish_reason="length", partial=True,
                                    dropped_tool_names=("g",), dropped_tool_indexes=(1,)))
    assert r["tool_calls"] == [{"id": "a", "name": "f", "arguments": "{}"}]
    assert r["dropped_tool_names"] == ["g"]
    assert r["partial"] is True


def test_a_new_content_per_attempt_voids_the_old_one() -> None:
    """The sink starts a fresh Content at every authorize (reset or not)."""
    first = Content()
    feed(first, [("text", "attempt one")])
    second = Content()
    feed(second, [("text", "attempt two")])
    assert second.build_response(meta_from_wire({}))["content"] == "attempt two"


def test_visible_chars_ignores_whitespace_and_reasoning() -> None:
    c = Content()
    feed(c, [("reasoning", "long thoughts"), ("text", "  \n"), ("tool_call", {"index": 0})])
    assert c.visible_chars() == 0
    feed(c, [("text", "Hi ")])
    assert c.visible_chars() == 2
    feed(c, [("refusal", " no"), ("text", "  ")])
    assert c.visible_chars() == 4  # per delta: protocol.messages.visible_chars


@pytest.mark.parametrize("data", [
    "text", None, [], {"index": -1}, {"index": True}, {"index": "0"}, {"index": 0, "id": 5},
    {"index": 0, "arguments": b"bytes"}, {"index": 0, "extra": 1}, {"index": 10**9},
])
def test_bad_tool_fragments_are_refused(data: Any) -> None:
    with pytest.raises(ValueError):
        check_tool_fragment(data)


@pytest.mark.parametrize("meta,field", [
    ({"partial": "yes"}, "partial"), ({"usage": [1]}, "usage"),
    ({"finish_reason": 3}, "finish_reason"), ({"dropped_tool_indexes": ["0"]}, "dropped_tool_indexes"),
    ({"dropped_tool_names": [1]}, "dropped_tool_names"), ({"model": True}, "model"),
])
def test_bad_meta_names_the_field(meta: dict[str, Any], field: str) -> None:
    with pytest.raises(BadFrame, match=field):
        meta_from_wire(meta)


def test_meta_passes_usage_and_ids_through() -> None:
    usage = {"prompt_tokens": 3, "completion_tokens": 5}
    meta = meta_from_wire({"usage": usage, "provider_response_id": "resp_1",
                           "unknown_key": "ignored"})
    r = Content().build_response(meta)
    assert r["usage"] == usage and r["provider_response_id"] == "resp_1"


# ---- the hot path's pre-encoded pieces ------------------------------------------

@pytest.mark.parametrize("kind", [k.value for k in DeltaKind])
@pytest.mark.parametrize("call_id,attempt,seq", [("c", 1, 1), ("call-" + "x" * 40, 300, 70_000),
                                                  ("ünï", 2**31, 2**40)])
def test_fast_delta_event_bytes_equal_the_reference(kind: str, call_id: str, attempt: int,
                                                    seq: int) -> None:
    data: Any = {"index": 0, "id": "a", "name": "f", "arguments": "{}"} \
        if kind == "tool_call" else "héllo"
    packer = msgpack.Packer(use_bin_type=True, datetime=False)
    # What the hot path (process.Sink._take) builds, stores and sends to listeners as is.
    fast = delta_prefix(call_id, attempt) + packer.pack(seq) + KIND_TAIL[kind] + packer.pack(data)
    assert fast == encode(delta_event(call_id, attempt, seq, kind, data))
    assert msgpack.unpackb(fast) == delta_event(call_id, attempt, seq, kind, data)


# ---- shape checks of internal messages ------------------------------------------

def test_parse_control_records() -> None:
    assert parse_control([C_STATS, 7]) == Stats(7)
    assert parse_control([C_AUTHORIZE, "r1", "c", 2, True]) == Authorize("r1", "c", 2, True)
    assert parse_control([C_AUTHORIZE, 1, "c", 2, False, "gpt"]) == Authorize(1, "c", 2, False, "gpt")
    op = parse_control([C_FINISH, 1, "c", "partial", None, 2, {"partial": True}])
    assert isinstance(op, Finish) and op.status is CallStatus.PARTIAL and op.meta.partial
    assert parse_control([C_SUBSCRIBE, 5, "c", LISTENER, -1, True, ["a", 0, 0]]) == \
        AddSubscriber(5, "c", LISTENER, FROM_NOW, True, OWNER)
    assert parse_control([C_SUBSCRIBE, "r", "c", LISTENER, 7, False, ["a", 2, 3]]) == \
        AddSubscriber("r", "c", LISTENER, 7, False, ListenerOwner("a", 2, 3))


@pytest.mark.parametrize("op", [
    Stats(3), Fence(1, "c", 2), Authorize("r", "c", 2, True, "gpt"), Authorize(1, "c", 1, False),
    Finish(4, "c", CallStatus.PARTIAL, {"code": "x", "message": "y"}, 2,
           FinishMeta("length", {"total_tokens": 1}, "m", "r1", True, ("f",), (1,))),
    AddSubscriber(6, "c", LISTENER, 0, True, OWNER),
    AddSubscriber("r", "c", LISTENER, FROM_NOW, True, ListenerOwner("b", 64, 1024)),
    AddSubscriber(7, "c", LISTENER, 12, False, OWNER),
])
def test_control_builder_and_parser_agree(op: Any) -> None:
    assert parse_control(msgpack.unpackb(encode_control(op))) == op


@pytest.mark.parametrize("msg,has_req", [
    ({"op": "x"}, False), ([C_STATS], False), ([C_STATS, 1.5], False), ([99, 1], True),
    ([C_AUTHORIZE, 1, "c", 0, False], True), ([C_AUTHORIZE, 1, "c", True, False], True),
    ([C_AUTHORIZE, 1, "", 1, False], True), ([C_AUTHORIZE, 1, "c", 1, 1], True),
    ([C_FENCE, 1, "c"], True), ([C_FINISH, 1, "c", "done", None, 1, None], True),
    ([C_FINISH, 1, "c", "failed", "boom", 1, None], True),
    ([C_FINISH, 1, "c", "failed", None, 1, {"partial": 1}], True),
    ([C_SUBSCRIBE, 1, "c", LISTENER, 0, True], True),
    ([C_SUBSCRIBE, 1, "c", "short", 0, True, W_OWNER], True),
    ([C_SUBSCRIBE, 1, "c", LISTENER[:-1] + "!", 0, True, W_OWNER], True),
    ([C_SUBSCRIBE, 1, "c", LISTENER.encode(), 0, True, W_OWNER], True),
    ([C_SUBSCRIBE, 1, "c", LISTENER, -2, True, W_OWNER], True),
    ([C_SUBSCRIBE, 1, "c", LISTENER, 0, 1, W_OWNER], True),
    ([C_SUBSCRIBE, 1, "c", LISTENER, True, True, W_OWNER], True),
    ([C_SUBSCRIBE, 1, "c", LISTENER, 0, True, "a"], True),
    ([C_SUBSCRIBE, 1, "c", LISTENER, 0, True, ["", 0, 0]], True),
    ([C_SUBSCRIBE, 1, "c", LISTENER, 0, True, ["a", -1, 0]], True),
    ([C_SUBSCRIBE, 1, "c", LISTENER, 0, True, ["a", 0, True]], True),
])
def test_parse_control_refuses_bad_shapes(msg: Any, has_req: bool) -> None:
    with pytest.raises(BadFrame) as info:
        parse_control(msg)
    assert (info.value.req is not None) == has_req


@pytest.mark.parametrize("msg", [
    [1, "c", 1, 2], [1, "c", 1, 2, []], [1, 5, 1, 2, OK], [1, "c", 0, 2, OK], [1, "c", 1, -1, OK],
    [True, "c", 1, 2, OK], [1, "c", 1, 2, {"ok": True}], [1, "c", 1, 2, OK[:-1]],
])
def test_parse_final_refuses_bad_shapes(msg: Any) -> None:
    with pytest.raises(BadFrame):
        parse_final(msg)


def test_parse_final_parses_the_outcome_once() -> None:
    final = parse_final([1, "c", 1, 2, OK])
    assert final.outcome == AttemptOutcome(ok=True, finish_reason="stop")
