"""streamfence.protocol.client_core driven by hand: the client's flows without a socket.

The test plays the shell: it reads each effect a flow yields, "sends" by
decoding the frames, "receives" by routing frames into the core's Router,
and resumes the flow.
"""

from __future__ import annotations

from time import sleep
from typing import Any

import pytest

from streamfence.protocol.client_core import ClientCore
from streamfence.protocol.client_effects import Flow, Send, Wait
from streamfence.protocol.client_router import ClientError, Router
from streamfence.protocol.codec import DEFAULT_MAX_FRAME, decode_untrusted, encode
from streamfence.protocol.messages import (
    CallStatus,
    accepted_msg,
    delta_event,
    done_event,
    empty_response,
    listening_msg,
)


def core(timeout_s: float = 1.0) -> ClientCore:
    return ClientCore("ipc://nowhere", timeout_s, DEFAULT_MAX_FRAME)


def sent(effect: object) -> dict[str, Any]:
    assert isinstance(effect, Send)
    msg = decode_untrusted(effect.frames[0], DEFAULT_MAX_FRAME)
    assert isinstance(msg, dict)
    return msg


def listened(c: ClientCore, flow: Flow[Any]) -> object:
    """Play the events socket's part: the flow says `listen` there first and waits
    for `listening`; returns the effect after it."""
    effect = next(flow)
    assert isinstance(effect, Send) and effect.to_events
    assert sent(effect) == {"v": 1, "op": "listen"}
    assert isinstance(next(flow), Wait)
    c.router.route([encode(listening_msg())])
    return next(flow)


def returned(flow: Flow[Any]) -> Any:
    with pytest.raises(StopIteration) as stop:
        next(flow)
    return stop.value.value


def test_a_request_flow_sends_then_waits_for_its_ref() -> None:
    c = core()
    flow = c.status()
    msg = sent(next(flow))
    assert msg["op"] == "status"
    assert isinstance(next(flow), Wait)
    c.router.route([encode({"v": 1, "op": "status_reply", "ref": msg["ref"], "workers": 2})])
    assert returned(flow)["workers"] == 2


def test_a_send_failure_thrown_into_a_flow_forgets_its_ref() -> None:
    c = core()
    flow = c.result("c1")
    ref = sent(next(flow))["ref"]
    with pytest.raises(TimeoutError, match="could not send"):
        flow.throw(c.send_failed("result of call c1"))
    assert c.router.route([encode({"v": 1, "op": "pending", "ref": ref})]) is False


def test_the_event_reader_refills_a_gap_then_probes_a_silent_call() -> None:
    c = core(timeout_s=0.05)
    c.router.route([encode(delta_event("c1", 1, 1, "text", "a"))])
    c.router.route([encode(delta_event("c1", 1, 3, "text", "c"))])  # seq 2 is missing
    events = c.events("c1", None)
    assert events.take() is not None and events.take() is None
    flow = events.wait()
    assert sent(listened(c, flow)) | {"ref": None} == {
        "v": 1, "op": "subscribe", "ref": None, "call_id": "c1", "from_seq": 1,
        "listener": c.listener}
    assert isinstance(next(flow), Wait)
    sleep(0.06)  # silent for longer than timeout_s: a probe is due
    assert sent(next(flow))["op"] == "subscribe"
    result = sent(next(flow))
    assert result["op"] == "result" and result["wait_s"] == 0
    assert isinstance(next(flow), Wait)
    done = done_event("c1", 4, CallStatus.COMPLETED, empty_response(), None, 1)
    c.router.route([encode(delta_event("c1", 1, 2, "text", "b"))])
    c.router.route([encode({**done, "ref": result["ref"]})])  # the probe finds it done
    assert returned(flow)["seq"] == 2
    assert [e["seq"] for e in iter(events.take, None)] == [3, 4]  # the probe's done delivered
    assert events.ended and returned(events.wait()) is None


# ---- the events socket: listen once, before the first request naming the listener ----------

def test_submit_listens_first_and_names_its_listener_only_after_listening() -> None:
    c = core()
    assert c.events_endpoint == "ipc://nowhere.events" and len(c.listener) == 32
    assert c.listener != core().listener  # each client its own (a secret)
    flow = c.submit("openai", {"model": "m"})
    listen = next(flow)
    assert isinstance(listen, Send) and listen.to_events and sent(listen) == {"v": 1,
                                                                             "op": "listen"}
    assert isinstance(next(flow), Wait)
    # anything but `listening` leaves it waiting, the submit unsent
    assert c.router.route([encode(delta_event("c0", 1, 1, "text", "x"))]) is False
    assert isinstance(next(flow), Wait) and not c.router.listening
    assert c.router.route([encode(listening_msg())]) is True and c.router.listening
    submit = next(flow)
    assert isinstance(submit, Send) and not submit.to_events
    msg = sent(submit)
    assert msg["op"] == "submit" and msg["listener"] == c.listener and "subscribe" not in msg
    assert isinstance(next(flow), Wait)
    c.router.route([encode(accepted_msg(msg["ref"], "c1"))])
    assert returned(flow) == "c1"
    # listening already: the next submit and subscribe go at once
    again = c.submit("openai", {"model": "m"})
    assert sent(next(again))["listener"] == c.listener
    sub = c.subscribe("c1", from_seq=3)
    msg = sent(next(sub))
    assert (msg["op"], msg["call_id"], msg["from_seq"], msg["listener"]) == (
        "subscribe", "c1", 3, c.listener)
    returned(sub)


def test_subscribe_listens_first() -> None:
    c = core()
    flow = c.subscribe("c1")
    msg = sent(listened(c, flow))
    assert msg["op"] == "subscribe" and msg["listener"] == c.listener
    returned(flow)


def test_submit_without_subscribing_neither_listens_nor_names_a_listener() -> None:
    c = core()
    flow = c.submit("openai", {"model": "m"}, subscribe=False)
    effect = next(flow)
    assert isinstance(effect, Send) and not effect.to_events
    msg = sent(effect)
    assert msg["op"] == "submit" and "listener" not in msg and "subscribe" not in msg
    assert not c.router.listening


def test_no_listening_in_time_is_a_timeout_and_the_request_is_never_sent() -> None:
    c = core(timeout_s=0.05)
    flow = c.submit("openai", {"model": "m"})
    assert sent(next(flow))["op"] == "listen"
    assert isinstance(next(flow), Wait)
    sleep(0.06)
    with pytest.raises(TimeoutError, match=r"no answer to listen from the events endpoint "
                                           r"ipc://nowhere\.events within 0\.05 s"):
        next(flow)


def drive(flow: Flow[Any], answer: Any) -> Any:
    """Run a flow to its end: each message it sends goes to `answer` (the daemon's
    part, which routes what it sends back); a Wait just resumes."""
    try:
        effect = next(flow)
        while True:
            if isinstance(effect, Send):
                answer(sent(effect))
            else:
                sleep(0.001)
            effect = next(flow)
    except StopIteration as stop:
        return stop.value


def test_a_duplicate_submit_gets_the_replay_routed_before_its_accepted() -> None:
    """Two sockets: the replay of a call this client already read to its done can
    be routed (the events socket first) before the duplicate submit's
    `accepted`. The new reader must still get the call's events, without
    waiting for a liveness probe."""
    c = core(timeout_s=5.0)  # a probe would come too late for the reader's 0.5 s
    replay = [delta_event("c1", 1, 1, "text", "Hi"),
              done_event("c1", 2, CallStatus.COMPLETED, empty_response(), None, 1)]

    def daemon(msg: dict[str, Any]) -> None:
        if msg["op"] == "listen":
            c.router.route([encode(listening_msg())])
            return
        for event in replay:  # both sockets ready: the events are routed first
            if event["seq"] > msg.get("from_seq", 0):
                c.router.route([encode(event)])
        if msg["op"] == "submit":
            c.router.route([encode(accepted_msg(msg["ref"], "c1", duplicate=True))])

    def read(call_id: str) -> list[int]:
        events = c.events(call_id, 0.5)
        got = []
        while (event := events.take() or drive(events.wait(), daemon)) is not None:
            got.append(event["seq"])
        return got

    assert read(drive(c.submit("openai", {"model": "m"}, idempotency_key="dup"), daemon)) == [1, 2]
    assert read(drive(c.submit("openai", {"model": "m"}, idempotency_key="dup"), daemon)) == [1, 2]


def test_the_router_takes_a_batch_of_events_as_if_each_came_alone() -> None:
    """The events socket may send an array of event maps (one commit's worth)."""
    router = Router()
    router.reading("c", 0)
    batch = b"\x93" + b"".join(encode(e) for e in (
        delta_event("c", 1, 2, "text", "b"), delta_event("c", 1, 1, "text", "a"),
        done_event("c", 3, CallStatus.COMPLETED, None, None, 1)))
    assert router.route([batch]) is False
    assert [router.next_event("c")["seq"] for _ in range(3)] == [1, 2, 3]  # type: ignore[index]
    for bad in ([{"v": 1, "op": "accepted", "ref": "r"}], [1], [{"v": 1, "op": "delta",
                                                               "ref": "r", "call_id": "c"}]):
        with pytest.raises(ClientError, match="not all events"):
            router.route([encode(bad)])
