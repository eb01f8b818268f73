"""The real sink process over real ZeroMQ ipc sockets.

The test plays the supervisor (a DEALER on sink.ctl) and the workers (DEALERs
on sink.in, in this process or in real spawned processes). Every wait has a
deadline and says what it waited for; every process started is killed and
joined in teardown.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import multiprocess
import pytest
import zmq

from streamfence.protocol.codec import encode
from streamfence.protocol.internal import (
    C_AUTHORIZE,
    C_FINISH,
    C_STATS,
    E_ENDED,
    E_EVENT,
    E_EVENTS,
    E_FINAL_REFUSED,
    R_OK,
    R_REFUSED,
    T_DELTA,
    T_FINAL,
    T_FINAL_ACK,
    Endpoints,
)
from streamfence.protocol.internal.control import AttemptStats, stats_from_wire
from streamfence.protocol.internal.outcome import AttemptOutcome, outcome_from_wire, outcome_to_wire
from streamfence.sink.process import run_sink
from streamfence.sink.store import TranscriptReader, events_after

MP = multiprocess.get_context("spawn")
START_S = 20.0  # a spawned child imports zmq, msgpack, sqlite3: well under this
WAIT_S = 10.0


def delta(call: str, attempt: int, seq: int, data: Any = "x", kind: str = "text") -> bytes:
    return encode([T_DELTA, call, attempt, seq, kind, data])


def final(call: str, attempt: int, last_seq: int, ok: bool = True) -> bytes:
    outcome = AttemptOutcome(ok=ok, finish_reason="stop", model="m")
    return encode([T_FINAL, call, attempt, last_seq, outcome_to_wire(outcome)])


class Supervisor:
    """The supervisor's end of sink.ctl: requests by id, events kept in order."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str) -> None:
        self.sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.inbox: list[list[Any]] = []
        self._req = 0

    def _recv_until(self, pred: Callable[[list[Any]], bool], what: str,
                    timeout: float = WAIT_S) -> list[Any]:
        deadline = time.monotonic() + timeout
        while True:
            for i, msg in enumerate(self.inbox):
                if pred(msg):
                    return self.inbox.pop(i)
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}; "
                                     f"last messages: {self.inbox[-5:]!r}")
            if self.sock.poll(int(left * 1000) + 1):
                msg = msgpack.unpackb(self.sock.recv())
                # A commit's events come batched; the tests reason per event.
                self.inbox.extend(msg[1] if msg[0] == E_EVENTS else [msg])

    def request(self, tag: int, *args: Any, timeout: float = WAIT_S) -> list[Any]:
        self._req += 1
        req = self._req
        self.sock.send(encode([tag, req, *args]))
        return self._recv_until(lambda m: m[0] in (R_OK, R_REFUSED) and m[1] == req,
                                f"the reply to {tag} {args}", timeout)

    def ok(self, tag: int, *args: Any) -> Any:
        reply = self.request(tag, *args)
        assert reply[0] == R_OK, f"expected R_OK for {tag} {args}, got {reply}"
        return reply[2]

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = self.ok(C_STATS)
        return stats

    def attempt_stats(self, tag: int, *args: Any) -> AttemptStats:
        """The reply to C_AUTHORIZE / C_FENCE: the previous attempt's stats."""
        return stats_from_wire(self.ok(tag, *args))

    def wait(self, tag: int, call: str, what: str, timeout: float = WAIT_S) -> list[Any]:
        return self._recv_until(lambda m: m[0] == tag and m[1] == call, what, timeout)

    def events(self, call: str, count: int, timeout: float = WAIT_S) -> list[dict[str, Any]]:
        """The next `count` E_EVENTs of `call`, decoded, checking the frame's seq."""
        out: list[dict[str, Any]] = []
        for _ in range(count):
            msg = self.wait(E_EVENT, call, f"event #{len(out) + 1} of {count} for {call}",
                            timeout)
            event = msgpack.unpackb(msg[3])
            assert event["seq"] == msg[2]
            out.append(event)
        return out

    def wait_stats(self, pred: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
        deadline = time.monotonic() + WAIT_S
        while True:
            stats = self.stats()
            if pred(stats):
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; stats: {stats}")
            time.sleep(0.01)


class SinkUnderTest:
    def __init__(self, runtime_dir: str, db_path: str) -> None:
        self.runtime_dir = runtime_dir
        self.db_path = db_path
        self.ep = Endpoints(runtime_dir)
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sockets: list[zmq.Socket[bytes]] = []
        self.procs: list[Any] = []
        self.proc: Any = None
        self.sup: Supervisor

    def start(self) -> SinkUnderTest:
        self.proc = MP.Process(target=run_sink, args=(self.runtime_dir, self.db_path, "DEBUG"),
                               name="sink-under-test")
        self.proc.start()
        self.procs.append(self.proc)
        self.sup = Supervisor(self.ctx, self.ep.sink_ctl)
        self.sockets.append(self.sup.sock)
        self.sup.request(C_STATS, timeout=START_S)  # answered once the sink serves
        return self

    def stop(self) -> int:
        self.proc.terminate()
        self.proc.join(WAIT_S)
        assert not self.proc.is_alive(), "the sink ignored SIGTERM"
        code: int = self.proc.exitcode
        return code

    def worker(self) -> zmq.Socket[bytes]:
        s: zmq.Socket[bytes] = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.ep.sink_in)
        self.sockets.append(s)
        return s

    def spawn(self, target: Callable[..., None], *args: Any) -> Any:
        p = MP.Process(target=target, args=args)
        p.start()
        self.procs.append(p)
        return p

    def transcript(self, call: str) -> list[dict[str, Any]]:
        return [msgpack.unpackb(e) for e in events_after(self.db_path, call, 0)]

    def close(self) -> None:
        for s in self.sockets:
            s.close(0)
        self.ctx.term()
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(WAIT_S)


@pytest.fixture
def sink(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SinkUnderTest]:
    # A short directory: ipc paths must fit in sun_path (107 bytes).
    runtime = tmp_path_factory.mktemp("rt")
    assert len(str(runtime / "sink.ctl")) < 100, runtime
    s = SinkUnderTest(str(runtime), str(runtime / "transcript.db"))
    try:
        yield s.start()
    finally:
        s.close()


def recv_ack(sock: zmq.Socket[bytes], timeout: float = WAIT_S) -> list[Any]:
    assert sock.poll(int(timeout * 1000)), f"no T_FINAL_ACK within {timeout}s"
    ack = msgpack.unpackb(sock.recv())
    assert ack[0] == T_FINAL_ACK
    return ack  # type: ignore[no-any-return]


# ---- worker processes (module level: spawn imports them by name) ----------------

def first_writer(ep_in: str, call: str, k: int, m: int, paused: Any, resume: Any) -> None:
    """Attempt 1: K deltas, pause until the switch, then M more and a final."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(ep_in)
    for seq in range(1, k + 1):
        s.send(delta(call, 1, seq, f"a1-{seq};"))
    paused.set()
    if not resume.wait(30):
        os._exit(3)
    for seq in range(k + 1, k + m + 1):
        s.send(delta(call, 1, seq, f"a1-{seq};"))
    s.send(final(call, 1, k + m))
    ok = s.poll(10_000) and msgpack.unpackb(s.recv())[3]
    s.close()
    ctx.term()
    os._exit(0 if ok is False else 1)  # 0: refused, as it must be


def second_writer(ep_in: str, call: str, n: int, go: Any) -> None:
    """Attempt 2: waits for the switch, then N deltas and a final."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(ep_in)
    if not go.wait(30):
        os._exit(3)
    for seq in range(1, n + 1):
        s.send(delta(call, 2, seq, f"a2-{seq};"))
    s.send(final(call, 2, n))
    ok = s.poll(10_000) and msgpack.unpackb(s.recv())[3]
    s.close()
    ctx.term()
    os._exit(0 if ok is True else 1)


def hasty_writer(ep_in: str, call: str, n: int) -> None:
    """N deltas and the final, then exit at once (default linger: close + term)."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(ep_in)
    for seq in range(1, n + 1):
        s.send(delta(call, 1, seq, f"{seq},"))
    s.send(final(call, 1, n))
    s.close()
    ctx.term()


# ---- the two-writer test (acceptance) -------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("reset", [False, True])
def test_two_writers_only_the_authorized_attempt_reaches_the_transcript(
        sink: SinkUnderTest, reset: bool) -> None:
    call, k, m, n = "two-writers", 40, 25, 30
    sup = sink.sup
    sup.ok(C_AUTHORIZE, call, 1, False)
    paused, resume, go = MP.Event(), MP.Event(), MP.Event()
    w1 = sink.spawn(first_writer, sink.ep.sink_in, call, k, m, paused, resume)
    w2 = sink.spawn(second_writer, sink.ep.sink_in, call, n, go)
    assert paused.wait(START_S), "writer 1 never sent its first deltas"
    # The switch point: every one of writer 1's first K deltas is in.
    before = sup.events(call, k)
    assert [e["data"] for e in before] == [f"a1-{s};" for s in range(1, k + 1)]

    prev = sup.attempt_stats(C_AUTHORIZE, call, 2, reset)
    assert prev == AttemptStats(attempt=1, accepted=k, dropped=0, visible_chars=prev.visible_chars,
                                tool_fragments=0, last_seq=k, closed=True)
    assert prev.visible_chars > 0
    resume.set()
    go.set()  # both writers now stream at the same time

    w2.join(WAIT_S)
    w1.join(WAIT_S)
    stats = sup.wait_stats(lambda s: s["accepted"] + s["dropped"] == k + m + n,
                           "every delta of both writers to be accepted or dropped")
    assert stats["dropped_by_call"].get(call) == m, \
        f"the fence should have dropped exactly the {m} deltas attempt 1 sent after the switch"
    assert stats["dropped_by_verdict"]["stale_attempt"] == m
    assert stats["accepted"] == k + n

    done = sup.ok(C_FINISH, call, "completed", None, 2, {"finish_reason": "stop"})
    transcript = sink.transcript(call)
    assert [e["seq"] for e in transcript] == list(range(1, len(transcript) + 1))
    switch = k + (1 if reset else 0)
    assert [(e["attempt"], e["data"]) for e in transcript[:k]] == \
        [(1, f"a1-{s};") for s in range(1, k + 1)]
    if reset:
        assert transcript[k]["op"] == "reset" and transcript[k]["attempt"] == 2
    after = transcript[switch:-1]
    assert [(e["op"], e["attempt"], e["data"]) for e in after] == \
        [("delta", 2, f"a2-{s};") for s in range(1, n + 1)], "attempt 1 wrote after the switch"
    assert transcript[-1]["op"] == "done"
    assert done["response"]["content"] == "".join(f"a2-{s};" for s in range(1, n + 1))

    assert w2.exitcode == 0, "attempt 2's final was not acknowledged as accepted"
    assert w1.exitcode == 0, "attempt 1's final after the switch was not refused"
    ended = sup.wait(E_ENDED, call, "E_ENDED of attempt 2")
    ended_stats = stats_from_wire(ended[3])
    assert ended[2] == 2 and ended_stats.accepted == n and ended_stats.dropped == 0
    refused = sup.wait(E_FINAL_REFUSED, call, "E_FINAL_REFUSED of attempt 1")
    assert refused[2] == 1 and refused[3].startswith("stale_attempt")


# ---- finals ----------------------------------------------------------------------

@pytest.mark.slow
def test_worker_that_exits_right_after_its_final_loses_nothing(sink: SinkUnderTest) -> None:
    call, n = "hasty", 5000
    sink.sup.ok(C_AUTHORIZE, call, 1, False)
    w = sink.spawn(hasty_writer, sink.ep.sink_in, call, n)
    ended = sink.sup.wait(E_ENDED, call, "E_ENDED of the hasty worker", timeout=START_S)
    # Everything in the inbox arrived before E_ENDED: the events came first.
    assert sum(1 for m in sink.sup.inbox if m[0] == E_EVENT and m[1] == call) == n
    # E_ENDED is sent after the commit: the store already holds every seq.
    seqs = [e["seq"] for e in sink.transcript(call)]
    assert seqs == list(range(1, n + 1))
    stats = stats_from_wire(ended[3])
    assert stats.accepted == n and stats.last_seq == n
    assert outcome_from_wire(ended[4]) == AttemptOutcome(ok=True, finish_reason="stop", model="m")
    w.join(WAIT_S)
    assert w.exitcode == 0


def test_final_with_wrong_last_seq_is_refused_and_reported(sink: SinkUnderTest) -> None:
    call = "mismatch"
    sink.sup.ok(C_AUTHORIZE, call, 1, False)
    worker = sink.worker()
    for seq in range(1, 11):
        worker.send(delta(call, 1, seq))
    worker.send(final(call, 1, 12))  # claims two deltas the sink never got
    ack = recv_ack(worker)
    assert ack[1:4] == [call, 1, False] and "seq_mismatch" in ack[4], ack
    refused = sink.sup.wait(E_FINAL_REFUSED, call, "E_FINAL_REFUSED")
    assert refused[2] == 1 and "final says 12" in refused[3]
    assert [m[2] for m in sink.sup.inbox if m[0] == E_EVENT] == list(range(1, 11)), \
        "E_FINAL_REFUSED overtook the attempt's events"
    # Nothing changed: the right final is still accepted, and acked again if repeated.
    worker.send(final(call, 1, 10))
    assert recv_ack(worker)[3] is True
    assert stats_from_wire(sink.sup.wait(E_ENDED, call, "E_ENDED")[3]).closed is True
    worker.send(final(call, 1, 10))
    assert recv_ack(worker)[3:] == [True, "repeated"]
    assert sink.sup.stats()["finals_refused"] == 1


# ---- finish ----------------------------------------------------------------------

def test_finish_builds_commits_then_publishes_the_done_event(sink: SinkUnderTest) -> None:
    call, sup = "finish", sink.sup
    sup.ok(C_AUTHORIZE, call, 1, False)
    worker = sink.worker()
    parts: list[tuple[str, Any]] = [
        ("reasoning", "hmm"), ("text", "Hello "), ("text", "world"),
        ("tool_call", {"index": 0, "id": "t0", "name": "f", "arguments": "{\"a\":"}),
        ("tool_call", {"index": 1, "id": "t1", "name": "g", "arguments": "{"}),
        ("tool_call", {"index": 0, "arguments": "1}"}), ("notice", "reconnected"),
    ]
    for seq, (kind, data) in enumerate(parts, 1):
        worker.send(delta(call, 1, seq, data, kind))
    worker.send(final(call, 1, len(parts)))
    assert recv_ack(worker)[3] is True
    sup.events(call, len(parts))
    meta = {"finish_reason": "tool_calls", "usage": {"total_tokens": 9}, "model": "m",
            "provider_response_id": "r1", "partial": False, "dropped_tool_names": ["g"],
            "dropped_tool_indexes": [1]}
    sup.sock.send(encode([C_FINISH, "fin", call, "completed", None, 1, meta]))
    published = sup.wait(E_EVENT, call, "the done event")
    # Read the store the moment it is published: it must already be there.
    reader = TranscriptReader(sink.db_path)
    try:
        assert reader.done_event(call) == published[3]
    finally:
        reader.close()
    reply = sup._recv_until(lambda m: m[1] == "fin", "the C_FINISH reply")
    assert reply[0] == R_OK
    done = reply[2]
    assert msgpack.unpackb(published[3]) == done
    assert done["seq"] == published[2] == len(parts) + 1
    assert done["status"] == "completed" and done["attempts"] == 1 and done["error"] is None
    resp = done["response"]
    assert resp["content"] == "Hello world" and resp["reasoning"] == "hmm"
    assert resp["tool_calls"] == [{"id": "t0", "name": "f", "arguments": "{\"a\":1}"}]
    assert resp["dropped_tool_names"] == ["g"] and resp["usage"] == {"total_tokens": 9}
    # Idempotent: the same done event, nothing new published; no new attempt.
    assert sup.ok(C_FINISH, call, "failed", None, 2, None) == done
    assert sup.request(C_AUTHORIZE, call, 2, False)[0] == R_REFUSED
    assert len(events_after(sink.db_path, call, 0)) == len(parts) + 1
    worker.send(delta(call, 1, len(parts) + 1))
    sup.wait_stats(lambda s: s["dropped_by_verdict"]["closed"] == 1, "the late delta's drop")


def test_finish_refuses_bad_meta_and_keeps_the_call_open(sink: SinkUnderTest) -> None:
    sink.sup.ok(C_AUTHORIZE, "c", 1, False)
    reply = sink.sup.request(C_FINISH, "c", "completed", None, 1, {"partial": "no"})
    assert reply[0] == R_REFUSED and "meta.partial" in reply[2]
    worker = sink.worker()
    worker.send(delta("c", 1, 1))
    assert sink.sup.events("c", 1)[0]["data"] == "x"
