"""The real sink process under forged deltas, garbage frames, SIGTERM, restart and
the death of its parent. Harness: tests.test_sink_process."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import msgpack
import multiprocess
import pytest
import zmq

from streamfence.protocol.codec import encode
from streamfence.protocol.internal import (
    C_AUTHORIZE,
    C_FENCE,
    C_FINISH,
    C_STATS,
    R_REFUSED,
    T_DELTA,
    T_FINAL,
)
from streamfence.protocol.internal.control import (
    AddSubscriber,
    ListenerOwner,
    encode_control,
    stats_from_wire,
)
from streamfence.sink.fence import Verdict
from streamfence.sink.process import run_sink
from streamfence.sink.state import SinkState
from streamfence.sink.store import TranscriptStore
from streamfence.sink.transcript import TranscriptReader
from tests.fakes import Nobody
from tests.test_sink_process import (
    MP,
    START_S,
    WAIT_S,
    SinkUnderTest,
    delta,
    final,
    recv_ack,
    sink,
)

__all__ = ["sink"]  # the fixture, re-used from the harness module


def sink_parent(runtime_dir: str, db_path: str, pids: Any) -> None:
    """Starts a sink and reports its pid, then idles until killed."""
    p = multiprocess.get_context("spawn").Process(
        target=run_sink, args=(runtime_dir, db_path, "ipc://" + os.path.join(runtime_dir, "ev"),
                               None, "WARNING"))
    p.start()
    pids.put(p.pid)
    signal.pause()  # until the test kills us



# ---- refusals and garbage --------------------------------------------------------

def test_forged_deltas_are_refused_and_counted(sink: SinkUnderTest) -> None:
    sup = sink.sup
    sup.ok(C_AUTHORIZE, "c", 1, False)
    sup.ok(C_AUTHORIZE, "c", 2, False)
    worker = sink.worker()
    worker.send(delta("c", 2, 1, "good"))
    for frame in (delta("c", 1, 1), delta("c", 1, 2),  # stale (superseded) attempt
                  delta("c", 3, 1),  # future attempt
                  delta("nobody", 1, 1),  # unknown call
                  delta("c", 2, 3),  # gap: 2 is next
                  delta("c", 2, 1)):  # duplicate
        worker.send(frame)
    worker.send(delta("c", 2, 2, "good too"))
    assert [e["data"] for e in sink.events("c", 2)] == ["good", "good too"]
    stats = sup.wait_stats(lambda s: s["dropped"] == 6, "6 drops")
    assert stats["dropped_by_verdict"] == {
        "stale_attempt": 2, "future_attempt": 1, "unknown_call": 1, "closed": 0,
        "gap": 1, "duplicate": 1}
    assert stats["dropped_by_call"] == {"c": 5} and stats["accepted"] == 2
    sup.ok(C_FENCE, "c", 2)
    worker.send(delta("c", 2, 3))
    sup.wait_stats(lambda s: s["dropped_by_verdict"]["closed"] == 1, "the closed drop")
    assert [e["data"] for e in sink.transcript("c")] == ["good", "good too"]


GARBAGE_IN: list[list[bytes]] = [
    [b"\xc1 not msgpack"], [b""], [encode([T_DELTA, "c", 1, 1, "text", "x"])[:-2]],
    [encode({"op": "delta"})], [encode([T_DELTA, "c", 1])], [encode(42)],
    [encode([T_DELTA, "c", "1", 1, "text", "x"])], [encode([T_DELTA, "c", 1, 1, "bogus", "x"])],
    [encode([T_DELTA, "c", 1, True, "text", "x"])], [encode([T_DELTA, "c", 1, 1, "text", 5])],
    [encode([T_DELTA, "c", 1, 1, "tool_call", {"index": "0"}])],
    [msgpack.packb([T_DELTA, "c", 1, 1, "text", msgpack.ExtType(1, b"x")])],
    [msgpack.packb(msgpack.ExtType(5, b"abc"))], [encode([T_FINAL, "c"])], [encode([77, 1])],
    [b"\xdd\xff\xff\xff\xff"], [b"\x01junk", b"second part", b"third part"],
    [encode([T_FINAL, "c", 1, 0, {}]), b"extra part"],
    [encode([T_FINAL, "c", 1, 0, {"ok": True}])], [encode([T_FINAL, "c", 1, 0, [True, None]])],
]
GARBAGE_CTL: list[list[bytes]] = [
    [b"\xc1"], [encode("stats")], [encode([C_STATS])], [encode([C_STATS, 1.5])],
    [encode([C_STATS, 1]), b"extra"], [msgpack.packb([C_FENCE, 1, "c", msgpack.ExtType(1, b"")])],
]
# Malformed but with a readable request id: answered with R_REFUSED.
REFUSED_CTL = [[C_AUTHORIZE, 901, "c", 0, False], [99, 902], [C_FINISH, 903, "c", "done", None, 1, None]]


def test_garbage_on_both_sockets_is_counted_and_survived(sink: SinkUnderTest) -> None:
    sup = sink.sup
    garbage = sink.worker()
    for parts in GARBAGE_IN:
        garbage.send_multipart(parts)
    stranger = sink.ctx.socket(zmq.DEALER)
    sink.sockets.append(stranger)
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.connect(sink.ep.sink_ctl)
    for parts in GARBAGE_CTL:
        stranger.send_multipart(parts)
    for msg in REFUSED_CTL:
        stranger.send(encode(msg))  # a stranger is never answered, only counted
    for msg in REFUSED_CTL:  # the supervisor's own malformed request is answered
        sup.sock.send(encode(msg))
        reply = sup._recv_until(lambda m: m[0] == R_REFUSED,
                                "R_REFUSED for a malformed request")
        assert reply[2].startswith("bad_message"), reply
    expected = {"in": len(GARBAGE_IN), "ctl": len(GARBAGE_CTL) + 2 * len(REFUSED_CTL)}
    stats = sup.wait_stats(lambda s: s["bad_frames"] == expected, f"bad_frames == {expected}")
    assert stats["accepted"] == 0 and stats["dropped"] == 0
    # ... and the sink still works, on the same sockets.
    sup.ok(C_AUTHORIZE, "c", 1, False)
    garbage.send(delta("c", 1, 1, "still alive"))
    garbage.send(final("c", 1, 1))
    assert recv_ack(garbage)[3] is True
    assert sink.events("c", 1)[0]["data"] == "still alive"
    assert not stranger.poll(0), "garbage without a request id must not be answered"


# ---- lifecycle ---------------------------------------------------------------------

def test_sigterm_commits_and_exits_cleanly(sink: SinkUnderTest) -> None:
    sink.sup.ok(C_AUTHORIZE, "c", 1, False)
    worker = sink.worker()
    for seq in range(1, 301):
        worker.send(delta("c", 1, seq))
    sink.events("c", 300)
    assert sink.stop() == 0
    assert [e["seq"] for e in sink.transcript("c")] == list(range(1, 301))


def test_restart_keeps_epochs_and_seqs(sink: SinkUnderTest) -> None:
    sink.sup.ok(C_AUTHORIZE, "c", 3, False)
    worker = sink.worker()
    worker.send(delta("c", 3, 1))
    worker.send(delta("c", 3, 2))
    sink.events("c", 2)
    assert sink.stop() == 0
    sink.start()  # a new sink process on the same store and endpoints, a new listener
    sup = sink.sup
    for attempt in (2, 3):
        reply = sup.request(C_AUTHORIZE, "c", attempt, False)
        assert reply[0] == R_REFUSED and "stale_epoch" in reply[2], reply
    # The new sink knows what attempt 3 delivered (from the store), for the
    # supervisor's partial/retry decision.
    stats = stats_from_wire(sup.ok(C_FENCE, "c", 3))
    assert (stats.attempt, stats.accepted, stats.visible_chars) == (3, 2, 2)
    worker.send(delta("c", 3, 3))  # the old writer, still alive: closed
    sup.wait_stats(lambda s: s["dropped_by_verdict"]["closed"] == 1, "the old writer's drop")
    sup.ok(C_AUTHORIZE, "c", 4, True)
    worker.send(delta("c", 4, 1, "new"))
    # The new listener subscribed from seq 0 (at the first authorize above): the
    # stored events are replayed, then the new ones continue the same seqs.
    old1, old2, reset, new = sink.events("c", 4)
    assert [(e["op"], e["seq"], e["attempt"]) for e in (old1, old2)] == \
        [("delta", 1, 3), ("delta", 2, 3)]
    assert (reset["op"], reset["seq"]) == ("reset", 3) and (new["seq"], new["data"]) == (4, "new")


@pytest.mark.slow
def test_sink_dies_with_its_parent(sink: SinkUnderTest, tmp_path: Path) -> None:
    runtime = tmp_path / "p"
    runtime.mkdir()
    pids = MP.Queue()
    parent = sink.spawn(sink_parent, str(runtime), str(runtime / "t.db"), pids)
    child = pids.get(timeout=START_S)
    os.kill(parent.pid, signal.SIGKILL)
    parent.join(WAIT_S)
    deadline = time.monotonic() + WAIT_S
    while _alive(child):
        if time.monotonic() > deadline:
            os.kill(child, signal.SIGKILL)
            raise AssertionError("the sink outlived its parent (no parent-death signal)")
        time.sleep(0.01)
    pids.close()
    pids.join_thread()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_drop_log_line_is_greppable_and_sparse(tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """First drop of a (call, attempt) at WARNING with the counts, the rest at DEBUG."""
    state = SinkState(TranscriptStore(str(tmp_path / "t.db")), Nobody(), Nobody())
    try:
        assert state.calls.fence.authorize("c", 1) is None
        state.calls.live("c").start_attempt(1, "gpt-test")
        assert state.calls.fence.authorize("c", 2) is None
        caplog.set_level(logging.DEBUG, logger="streamfence.sink.fence")
        for seq in (7, 8):
            state.counters.drop("c", 1, seq, Verdict.STALE_ATTEMPT)
    finally:
        state.store.close()
    first, second = caplog.records
    assert first.levelno == logging.WARNING and second.levelno == logging.DEBUG
    assert first.getMessage() == (
        "fence: dropped delta from superseded attempt call=c attempt=1 current=2 seq=7 "
        "expected=- verdict=stale_attempt dropped=1 dropped_call=1 model=gpt-test")
    assert "dropped=2 dropped_call=2" in second.getMessage()


def test_every_published_event_is_already_stored(sink: SinkUnderTest) -> None:
    """Durable before visible: what a listener (and so a client) sees survives
    a kill -9, so a restarted sink can never hand out the same seq twice."""
    sink.sup.ok(C_AUTHORIZE, "c", 1, False)
    worker = sink.worker()
    for seq in range(1, 301):
        worker.send(delta("c", 1, seq, f"{seq},"))
    reader = TranscriptReader(sink.db_path)
    try:
        for seq in range(1, 301):
            raw, event = sink.listener.next("c", f"event {seq}")
            assert event["seq"] == seq, event
            stored = reader.events_after("c", seq - 1)
            assert stored and stored[0] == raw, f"event {seq} was published before its commit"
    finally:
        reader.close()
    sink.proc.kill()
    sink.proc.join(WAIT_S)
    assert [e["seq"] for e in sink.transcript("c")] == list(range(1, 301))


def test_only_the_supervisor_may_drive_the_sink(sink: SinkUnderTest) -> None:
    """A stranger on sink.ctl with well-formed control messages gets no answer,
    cannot subscribe its own listener (steals no events), and is counted; the
    supervisor keeps control."""
    stranger = sink.ctx.socket(zmq.DEALER)
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.connect(sink.ep.sink_ctl)
    sink.sockets.append(stranger)
    thief = sink.new_listener()  # connected and `listening` on the events socket
    stranger.send(encode([C_AUTHORIZE, 1, "hijack", 1, False]))
    stranger.send(encode_control(AddSubscriber(2, "hijack", thief.id, 0, True,
                                                    ListenerOwner("thief"))))
    sink.sup.wait_stats(lambda s: s["bad_frames"]["ctl"] >= 2, "the stranger to be counted")
    assert not stranger.poll(200), "the sink answered a stranger"
    sink.sup.ok(C_AUTHORIZE, "hijack", 1, False)  # the supervisor still drives it
    worker = sink.worker()
    worker.send(encode([T_DELTA, "hijack", 1, 1, "text", "mine"]))
    assert [e["data"] for e in sink.events("hijack", 1)] == ["mine"]
    assert not thief.sock.poll(200), "events went to a stranger's listener"
    stats = sink.sup.stats()
    assert stats["events_sent"] == 1 and stats["bad_frames"]["ctl"] == 2, stats
