"""Flow control on the sink's events socket (docs/PROTOCOL.md §5), real sink process.

A listener may hold at most `WINDOW_BYTES` of frames it has not acknowledged
(`ack` with the bytes read since `listen`). A live subscriber that falls that
far behind is cut off with a `cut_off` event naming the last seq it was sent
and resumes from there with no gap and no repeat; a replay is paced by the
acks and never cut off; repeated subscriptions to one call replace each
other. The harness is tests/test_sink_process.py's (a supervisor on sink.ctl,
workers on sink.in); the listeners here are raw DEALERs so that each test
decides when to ack.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq

from streamfence.protocol.codec import encode
from streamfence.protocol.internal import C_AUTHORIZE, C_FINISH
from streamfence.sink.subscribers import WINDOW_BYTES
from tests.test_sink_process import (
    LISTEN,
    WAIT_S,
    SinkUnderTest,
    delta,
    final,
    recv_ack,
    split_events,
)

BIG = "x" * (60 << 10)  # one delta's text: a window holds about 68 of them


class RawListener:
    """A DEALER on the events socket that acks only when told to."""

    def __init__(self, sink: SinkUnderTest) -> None:
        self.id = uuid.uuid4().hex
        self.sock: zmq.Socket[bytes] = sink.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, self.id.encode())
        self.sock.connect(sink.events_endpoint)
        sink.sockets.append(self.sock)
        self.read = 0  # bytes of every frame received since `listen`
        self.events: list[dict[str, Any]] = []  # everything received, in order
        self.sock.send(LISTEN)
        assert self.sock.poll(int(WAIT_S * 1000)), "no answer to listen"
        self.read = len(self.sock.recv())

    def ack(self) -> None:
        self.sock.send(encode({"v": 1, "op": "ack", "read": self.read}))

    def pump(self, until: Any, what: str, acking: bool = False,
             timeout: float = WAIT_S) -> None:
        """Receive until `until(self.events)` holds (acking as it reads if told)."""
        deadline = time.monotonic() + timeout
        if acking:
            self.ack()
        while not until(self.events):
            left = deadline - time.monotonic()
            assert left > 0, f"timed out after {timeout}s waiting for {what}; " \
                             f"{len(self.events)} received, the last ones (op, seq): " \
                             f"{[(e.get('op'), e.get('seq')) for e in self.events[-3:]]}"
            if self.sock.poll(int(min(left, 0.2) * 1000) + 1):
                while True:
                    try:
                        frame = self.sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.read += len(frame)
                    self.events.extend(msgpack.unpackb(e) for e in split_events(frame))
                if acking:
                    self.ack()

    def quiet_for(self, window_s: float) -> bool:
        """True if no frame arrives within `window_s` (the sink is waiting for an ack)."""
        return not self.sock.poll(int(window_s * 1000))

    def quiet(self, window_s: float = 0.3) -> int:
        """Frames that arrive within `window_s` (expected: none)."""
        n = 0
        while self.sock.poll(int(window_s * 1000)):
            self.sock.recv()
            n += 1
        return n


@pytest.fixture
def sink(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SinkUnderTest]:
    runtime = tmp_path_factory.mktemp("rt")
    s = SinkUnderTest(str(runtime), str(runtime / "transcript.db"))
    try:
        yield s.start()
    finally:
        s.close()


def deltas(events: list[dict[str, Any]], call: str) -> list[int]:
    return [e["seq"] for e in events if e.get("call_id") == call and e["op"] != "cut_off"]


def test_a_live_subscriber_a_window_behind_is_cut_off_and_resumes_with_no_gap_or_repeat(
        sink: SinkUnderTest) -> None:
    call, sup, n = "lagging", sink.sup, 150
    slow = RawListener(sink)
    sup.followed.add(call)  # the harness's listener does not follow this one
    sup.ok(C_AUTHORIZE, call, 1, False)
    sup.subscribe(call, slow)
    worker = sink.worker()
    for seq in range(1, n + 1):
        worker.send(delta(call, 1, seq, BIG))
    slow.pump(lambda ev: any(e["op"] == "cut_off" for e in ev), "the cut_off event")
    cut = next(e for e in slow.events if e["op"] == "cut_off")
    got = deltas(slow.events, call)
    assert got == list(range(1, cut["seq"] + 1)), "before the cut: every seq, in order, once"
    assert cut["call_id"] == call and "subscribe again from seq" in cut["reason"], cut
    assert 0 < cut["seq"] < n
    assert sum(len(BIG) for _ in got) <= WINDOW_BYTES + len(BIG), \
        f"{len(got)} deltas of {len(BIG)} bytes were sent to a listener that acked none"
    stats = sup.wait_stats(lambda st: st["accepted"] == n, f"{n} deltas accepted")
    assert stats["events_cut_offs"] == 1, stats
    assert slow.quiet() == 0, "events went on after the cut_off"

    # It catches up and subscribes again from the seq the cut_off named.
    slow.ack()
    sup.subscribe(call, slow, from_seq=cut["seq"])
    worker.send(final(call, 1, n))
    assert recv_ack(worker)[3] is True
    sup.ok(C_FINISH, call, "completed", None, 1, {"finish_reason": "stop"})
    slow.pump(lambda ev: any(e["op"] == "done" for e in ev), "the done after resuming",
              acking=True)
    assert deltas(slow.events, call) == list(range(1, n + 2)), "a gap or a repeat"
    assert sup.stats()["events_cut_offs"] == 1
    assert [e["seq"] for e in sink.transcript(call)] == list(range(1, n + 2))


def _stored(sink: SinkUnderTest, call: str, n: int) -> zmq.Socket[bytes]:
    """A call of `n` big deltas, ended and stored, that no listener follows;
    the worker socket that wrote it."""
    sup = sink.sup
    sup.followed.add(call)  # the harness's listener does not follow it
    sup.ok(C_AUTHORIZE, call, 1, False)
    worker = sink.worker()
    for seq in range(1, n + 1):
        worker.send(delta(call, 1, seq, BIG))
    worker.send(final(call, 1, n))
    assert recv_ack(worker)[3] is True
    sup.ok(C_FINISH, call, "completed", None, 1, {"finish_reason": "stop"})
    return worker


def test_a_replay_waits_for_acks_and_is_never_cut_off(sink: SinkUnderTest) -> None:
    call, sup, n = "replayed", sink.sup, 200
    worker = _stored(sink, call, n)

    reader = RawListener(sink)
    sup.subscribe(call, reader)
    reader.pump(lambda ev: len(ev) >= WINDOW_BYTES // len(BIG) - 8, "a window of the replay")
    reader.pump(lambda ev: reader.quiet_for(0.5), "the replay to pause")
    held = len(reader.events)
    assert held * len(BIG) <= WINDOW_BYTES + (256 << 10), held
    stats = sup.stats()
    assert stats["replays"] == 1 and stats["events_cut_offs"] == 0, stats

    # Meanwhile the sink serves the others: a new call's events flow.
    sup.ok(C_AUTHORIZE, "other", 1, False)
    worker.send(delta("other", 1, 1, "still live"))
    assert sink.events("other", 1)[0]["data"] == "still live"

    reader.pump(lambda ev: any(e["op"] == "done" for e in ev), "the rest of the replay",
                acking=True)
    assert deltas(reader.events, call) == list(range(1, n + 2))
    # The replay ends on the sink's next turn (it finds nothing more stored).
    stats = sup.wait_stats(lambda st: st["replays"] == 0, "the replay to end")
    assert stats["events_cut_offs"] == 0, stats


def test_repeated_subscriptions_to_one_call_replace_each_other(sink: SinkUnderTest) -> None:
    call, sup, n = "storm", sink.sup, 150
    _stored(sink, call, n)

    storm = RawListener(sink)
    for _ in range(100):
        sup.subscribe(call, storm)
    assert sup.stats()["replays"] == 1, "subscriptions stacked"
    storm.pump(lambda ev: any(e["op"] == "done" for e in ev), "the done", acking=True)
    got = deltas(storm.events, call)
    # Each subscribe restarted the one replay from seq 1; the sends of the
    # replaced ones were bounded by the window, not multiplied by 100.
    assert len(got) <= (n + 1) + WINDOW_BYTES // len(BIG) + 1, len(got)
    assert got[-(n + 1):] == list(range(1, n + 2))
    sup.wait_stats(lambda st: st["replays"] == 0, "the replay to end")
