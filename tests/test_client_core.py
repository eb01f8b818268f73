"""streamfence.protocol.client_core driven by hand: the client's flows without a socket.

The test plays the shell: it reads each effect a flow yields, "sends" by
decoding the frames, "receives" by routing frames into the core's Router,
and resumes the flow.
"""

from __future__ import annotations

from time import sleep
from typing import Any

import pytest

from streamfence.protocol.client_core import ClientCore, Flow, Send, Wait
from streamfence.protocol.codec import DEFAULT_MAX_FRAME, decode_untrusted, encode
from streamfence.protocol.messages import CallStatus, delta_event, done_event, empty_response


def core(timeout_s: float = 1.0) -> ClientCore:
    return ClientCore("ipc://nowhere", timeout_s, DEFAULT_MAX_FRAME)


def sent(effect: object) -> dict[str, Any]:
    assert isinstance(effect, Send)
    msg = decode_untrusted(effect.frames[0], DEFAULT_MAX_FRAME)
    assert isinstance(msg, dict)
    return msg


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
    assert sent(next(flow)) | {"ref": None} == {"v": 1, "op": "subscribe", "ref": None,
                                                 "call_id": "c1", "from_seq": 1}
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
