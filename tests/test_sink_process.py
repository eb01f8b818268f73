"""The real sink process over real ZeroMQ ipc sockets.

The test plays the supervisor (a DEALER on sink.ctl), the workers (DEALERs on
sink.in, in this process or in real spawned processes) and the subscribers (a
listener: a DEALER on the events endpoint, whose routing id is its listener
id). The harness's own listener follows every call the test authorizes
(C_SUBSCRIBE from seq 0, live), so `sink.events(...)` reads the public events
the sink sent. Every wait has a deadline and says what it waited for; every
process started is killed and joined in teardown.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import msgpack
import multiprocess
import pytest
import zmq

from streamfence.protocol.codec import encode
from streamfence.protocol.internal import (
    C_AUTHORIZE,
    C_FENCE,
    C_FINISH,
    C_REBIND,
    C_STATS,
    E_ENDED,
    E_FINAL_REFUSED,
    R_OK,
    R_REFUSED,
    T_DELTA,
    T_FINAL,
    T_FINAL_ACK,
    T_HELLO,
    T_REBIND,
    Endpoints,
)
from streamfence.protocol.internal.control import (
    FROM_NOW,
    AddSubscriber,
    AttemptStats,
    ListenerOwner,
    encode_control,
    stats_from_wire,
)
from streamfence.protocol.internal.outcome import AttemptOutcome, outcome_from_wire, outcome_to_wire
from streamfence.protocol.messages import visible_chars
from streamfence.sink.process import run_sink
from streamfence.sink.transcript import TranscriptReader, read_events_after
from tests.harness import is_listening

MP = multiprocess.get_context("spawn")
START_S = 20.0  # a spawned child imports zmq, msgpack, sqlite3: well under this
WAIT_S = 10.0


def delta(call: str, attempt: int, seq: int, data: Any = "x", kind: str = "text") -> bytes:
    return encode([T_DELTA, call, attempt, seq, kind, data])


def final(call: str, attempt: int, last_seq: int, ok: bool = True) -> bytes:
    outcome = AttemptOutcome(ok=ok, finish_reason="stop", model="m")
    return encode([T_FINAL, call, attempt, last_seq, outcome_to_wire(outcome)])


class Subscriber(Protocol):
    """What `Supervisor.subscribe` needs of a listener: its id (its routing id
    on the events socket)."""

    id: str


LISTEN = encode({"v": 1, "op": "listen"})


class Listener:
    """A subscriber's connection to the sink's events socket: a DEALER whose
    routing id is its listener id. Every frame after `listening` is one public
    event, the bytes the transcript stores; they are kept as (bytes, decoded)
    in arrival order and handed out per call, checking that each call's seqs
    arrive one after the other (no gap, no repeat) on this connection."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, timeout: float = WAIT_S) -> None:
        self.id = uuid.uuid4().hex
        self.sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, self.id.encode())
        self.sock.connect(endpoint)
        self.inbox: list[tuple[bytes, dict[str, Any]]] = []
        self.frames = 0  # frames received (a batch is one)
        self.last_seq: dict[str, int] = {}
        self.sock.send(LISTEN)
        # Answered once the connection is up: from then on, events can reach it.
        assert self.sock.poll(int(timeout * 1000)), \
            f"no answer to `listen` on {endpoint} within {timeout}s"
        frame = self.sock.recv()
        self.read = len(frame)  # bytes received since `listen` (PROTOCOL §5)
        reply = msgpack.unpackb(frame)
        assert is_listening(reply), f"expected listening, got {reply}"

    def next(self, call: str, what: str, timeout: float = WAIT_S) -> tuple[bytes, dict[str, Any]]:
        """The next event of `call`: its bytes as received, and decoded."""
        deadline = time.monotonic() + timeout
        while True:
            for i, (_, event) in enumerate(self.inbox):
                if event.get("call_id") == call:
                    raw, event = self.inbox.pop(i)
                    last = self.last_seq.get(call)
                    assert last is None or event["seq"] == last + 1, \
                        f"{call}: event seq {event['seq']} after {last} on one listener"
                    self.last_seq[call] = event["seq"]
                    return raw, event
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}; "
                                     f"last events: {[e for _, e in self.inbox[-5:]]!r}")
            if self.sock.poll(int(left * 1000) + 1):
                frames = self.sock.recv_multipart()
                self.frames += 1
                assert len(frames) == 1, f"a message is one frame, got {len(frames)}"
                self.read += len(frames[0])  # acked at once: this listener keeps up
                self.sock.send(encode({"v": 1, "op": "ack", "read": self.read}))
                for piece in split_events(frames[0]):
                    event = msgpack.unpackb(piece)
                    assert isinstance(event, dict) and event.get("v") == 1, event
                    self.inbox.append((piece, event))

    def events(self, call: str, count: int, timeout: float = WAIT_S) -> list[dict[str, Any]]:
        """The next `count` events of `call`, decoded."""
        return [self.next(call, f"event #{i + 1} of {count} for {call}", timeout)[1]
                for i in range(count)]


def split_events(frame: bytes) -> list[bytes]:
    """The event maps of one events-socket frame, each as its own bytes: the
    frame itself, or the elements of a batch (a msgpack array of them)."""
    if not frame or (frame[0] not in (0xdc, 0xdd) and not 0x90 <= frame[0] <= 0x9f):
        return [frame]
    unpacker = msgpack.Unpacker()
    unpacker.feed(frame)
    pieces = []
    for _ in range(unpacker.read_array_header()):
        start = unpacker.tell()
        unpacker.skip()
        pieces.append(frame[start:unpacker.tell()])
    assert unpacker.tell() == len(frame), "trailing bytes after a batch"
    return pieces


class Supervisor:
    """The supervisor's end of sink.ctl: requests by id, unsolicited messages
    (E_ENDED, E_FINAL_REFUSED) kept in order. Given a listener, it subscribes
    it (from seq 0, live) to each call before the first C_AUTHORIZE of that
    call it sends, as the real supervisor subscribes a submitter at submit."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str) -> None:
        self.sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.inbox: list[list[Any]] = []
        self.listener: Listener | None = None
        self.followed: set[str] = set()
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
                self.inbox.append(msgpack.unpackb(self.sock.recv()))

    def _send(self, frame_for: Callable[[int], bytes], what: str,
              timeout: float = WAIT_S) -> list[Any]:
        self._req += 1
        req = self._req
        self.sock.send(frame_for(req))
        return self._recv_until(lambda m: m[0] in (R_OK, R_REFUSED) and m[1] == req,
                                f"the reply to {what}", timeout)

    def request(self, tag: int, *args: Any, timeout: float = WAIT_S) -> list[Any]:
        if (tag == C_AUTHORIZE and self.listener is not None and args
                and isinstance(args[0], str) and args[0] not in self.followed):
            self.follow(args[0], self.listener)
        return self._send(lambda req: encode([tag, req, *args]), f"{tag} {args}", timeout)

    def subscribe(self, call: str, listener: Subscriber, from_seq: int = 0,
                  live: bool = True) -> list[Any]:
        """C_SUBSCRIBE (built by the supervisor's own encoder); the reply."""
        return self._send(lambda req: encode_control(
            AddSubscriber(req, call, listener.id, from_seq, live, ListenerOwner("test"))),
            f"C_SUBSCRIBE {call} {listener.id} from {from_seq} live={live}")

    def follow(self, call: str, listener: Listener, from_seq: int = 0) -> None:
        reply = self.subscribe(call, listener, from_seq, True)
        assert reply[0] == R_OK and reply[2] is None, f"subscribing to {call}: {reply}"
        self.followed.add(call)

    def ok(self, tag: int, *args: Any) -> Any:
        reply = self.request(tag, *args)
        assert reply[0] == R_OK, f"expected R_OK for {tag} {args}, got {reply}"
        if tag == C_FINISH and isinstance(reply[2], list):
            return reply[2][0]  # [the done, each attempt's refused deltas]
        return reply[2]

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = self.ok(C_STATS)
        return stats

    def attempt_stats(self, tag: int, *args: Any) -> AttemptStats:
        """The reply to C_AUTHORIZE / C_FENCE: the previous attempt's stats."""
        return stats_from_wire(self.ok(tag, *args))

    def wait(self, tag: int, call: str, what: str, timeout: float = WAIT_S) -> list[Any]:
        return self._recv_until(lambda m: m[0] == tag and m[1] == call, what, timeout)

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
        self.events_endpoint = "ipc://" + os.path.join(runtime_dir, "ev")
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sockets: list[zmq.Socket[bytes]] = []
        self.procs: list[Any] = []
        self.proc: Any = None
        self.sup: Supervisor
        self.listener: Listener

    def start(self) -> SinkUnderTest:
        self.proc = MP.Process(target=run_sink,
                               args=(self.runtime_dir, self.db_path, self.events_endpoint,
                                     None, "DEBUG"),
                               name="sink-under-test")
        self.proc.start()
        self.procs.append(self.proc)
        self.sup = Supervisor(self.ctx, self.ep.sink_ctl)
        self.sockets.append(self.sup.sock)
        self.sup.request(C_STATS, timeout=START_S)  # answered once the sink serves
        self.listener = self.sup.listener = self.new_listener()
        return self

    def new_listener(self) -> Listener:
        """Another subscriber connection, `listening` already."""
        listener = Listener(self.ctx, self.events_endpoint)
        self.sockets.append(listener.sock)
        return listener

    def events(self, call: str, count: int, timeout: float = WAIT_S) -> list[dict[str, Any]]:
        """The next `count` events of `call` the harness's listener received."""
        return self.listener.events(call, count, timeout)

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
        return [msgpack.unpackb(e) for e in read_events_after(self.db_path, call, 0)]

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
    before = sink.events(call, k)
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

    reply = sup.request(C_FINISH, call, "completed", None, 2, {"finish_reason": "stop"})
    done, refused = reply[2]
    assert refused == [[1, m]], refused  # the supervisor journals them with attempt 1
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
    # E_ENDED is sent after the commit: the store already holds every seq.
    seqs = [e["seq"] for e in sink.transcript(call)]
    assert seqs == list(range(1, n + 1))
    # ... and every one of them went to the call's listener, in order.
    assert [e["seq"] for e in sink.events(call, n)] == list(range(1, n + 1))
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
    # E_FINAL_REFUSED is sent after the commit of the attempt's events.
    assert [e["seq"] for e in sink.transcript(call)] == list(range(1, 11)), \
        "E_FINAL_REFUSED overtook the commit of the attempt's events"
    assert [e["seq"] for e in sink.events(call, 10)] == list(range(1, 11))
    # Nothing changed: the right final is still accepted, and acked again if repeated.
    worker.send(final(call, 1, 10))
    assert recv_ack(worker)[3] is True
    assert stats_from_wire(sink.sup.wait(E_ENDED, call, "E_ENDED")[3]).closed is True
    worker.send(final(call, 1, 10))
    assert recv_ack(worker)[3:] == [True, "repeated"]
    assert sink.sup.stats()["finals_refused"] == 1


# ---- rebind after a restart (ARCHITECTURE §2.8) ------------------------------------

def recv_rebind(sock: zmq.Socket[bytes], timeout: float = WAIT_S) -> list[Any]:
    assert sock.poll(int(timeout * 1000)), f"no T_REBIND within {timeout}s"
    answer = msgpack.unpackb(sock.recv())
    assert answer[0] == T_REBIND, answer
    return answer  # type: ignore[no-any-return]


def test_a_rebound_attempt_writes_on_after_the_stored_answer(sink: SinkUnderTest) -> None:
    """The answer of attempt 1 (as stored) goes on as attempt 2: its worker asks
    with its token and gets where to resume; the call's events stay one
    contiguous answer of attempt 1 to subscribers, no reset; epoch 1 can
    write no more."""
    call, sup = "rebind", sink.sup
    sup.ok(C_AUTHORIZE, call, 1, False)
    first = sink.worker()
    for seq in range(1, 6):
        first.send(delta(call, 1, seq, f"a{seq} "))
    sink.events(call, 5)  # committed
    stats = stats_from_wire(sup.ok(C_REBIND, call, 2, 1, 1, 7))
    assert stats.last_seq == 5 and stats.visible_chars == sum(
        visible_chars("text", f"a{seq} ") for seq in range(1, 6))
    worker = sink.worker()  # the worker's new connection
    worker.send(encode([T_HELLO, call, 1, 7]))
    assert recv_rebind(worker) == [T_REBIND, call, 1, 2, 5]
    first.send(delta(call, 1, 6, "stale"))
    for seq in range(6, 9):
        worker.send(delta(call, 2, seq, f"b{seq} "))
    worker.send(final(call, 2, 8))
    assert recv_ack(worker)[1:4] == [call, 2, True]
    done = sup.ok(C_FINISH, call, "completed", None, 1, None)
    assert done["response"]["content"] == "a1 a2 a3 a4 a5 b6 b7 b8 "
    events = sink.transcript(call)
    assert [e["seq"] for e in events] == list(range(1, 10))
    assert [e["op"] for e in events] == ["delta"] * 8 + ["done"]
    # One provider attempt is one attempt to a subscriber, whatever its epochs.
    assert [e["attempt"] for e in events[:8]] == [1] * 8
    assert sup.stats()["dropped_by_verdict"]["stale_attempt"] == 1


def test_a_hello_is_told_the_rebind_of_its_run_and_a_wrong_token_is_told_over(
        sink: SinkUnderTest) -> None:
    call, sup = "early-hello", sink.sup
    sup.ok(C_AUTHORIZE, call, 1, False)
    first = sink.worker()  # one connection: its deltas arrive in order
    for seq in range(1, 4):
        first.send(delta(call, 1, seq))
    sink.events(call, 3)
    sup.ok(C_FENCE, call, 1)  # as a restarted sink has it: closed, not rebound yet
    worker, intruder = sink.worker(), sink.worker()
    worker.send(encode([T_HELLO, call, 1, 7]))
    sup.ok(C_REBIND, call, 2, 1, 1, 7)
    # Read by the sink before the rebind (it waits) or after it: the answer is the rebind's.
    assert recv_rebind(worker) == [T_REBIND, call, 1, 2, 3]
    sup.ok(C_FENCE, call, 2)
    intruder.send(encode([T_HELLO, call, 1, 8]))  # not the run's token: never rebound
    sup.ok(C_FINISH, call, "completed", None, 1, None)  # before or after its hello: over
    assert recv_rebind(intruder) == [T_REBIND, call, 1, 0, 0]


def test_a_hello_to_the_same_open_attempt_resumes_after_its_last_seq(
        sink: SinkUnderTest) -> None:
    """Only the connection broke (the sink is the same): go on as yourself."""
    call = "same-sink"
    sink.sup.ok(C_AUTHORIZE, call, 1, False)
    first = sink.worker()  # one connection: its deltas arrive in order
    for seq in range(1, 4):
        first.send(delta(call, 1, seq))
    sink.events(call, 3)
    worker = sink.worker()
    worker.send(encode([T_HELLO, call, 1, 7]))
    assert recv_rebind(worker) == [T_REBIND, call, 1, 1, 3]


def test_a_hello_for_a_call_nobody_knows_is_told_over_and_kept_nowhere(
        sink: SinkUnderTest) -> None:
    before = sink.sup.stats()["calls_in_memory"]
    worker = sink.worker()
    for i in range(20):  # forged: no such calls
        worker.send(encode([T_HELLO, f"nobody-{i}", 1, 7]))
        assert recv_rebind(worker) == [T_REBIND, f"nobody-{i}", 1, 0, 0]
    assert sink.sup.stats()["calls_in_memory"] == before


def test_a_rebind_is_refused_at_or_below_the_epoch(sink: SinkUnderTest) -> None:
    call, sup = "stale-rebind", sink.sup
    sup.ok(C_AUTHORIZE, call, 3, False)
    reply = sup.request(C_REBIND, call, 3, 2, 2, 7)
    assert reply[0] == R_REFUSED and "stale_epoch" in reply[2], reply


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
    sink.events(call, len(parts))
    meta = {"finish_reason": "tool_calls", "usage": {"total_tokens": 9}, "model": "m",
            "provider_response_id": "r1", "partial": False, "dropped_tool_names": ["g"],
            "dropped_tool_indexes": [1]}
    sup.sock.send(encode([C_FINISH, "fin", call, "completed", None, 1, meta]))
    raw, published = sink.listener.next(call, "the done event")
    # Read the store the moment it is published: it must already be there.
    reader = TranscriptReader(sink.db_path)
    try:
        assert reader.done_event(call) == raw
    finally:
        reader.close()
    reply = sup._recv_until(lambda m: m[1] == "fin", "the C_FINISH reply")
    assert reply[0] == R_OK
    done, refused = reply[2]
    assert refused == []  # no delta of the call was refused
    assert published == done
    assert done["seq"] == published["seq"] == len(parts) + 1
    assert done["status"] == "completed" and done["attempts"] == 1 and done["error"] is None
    resp = done["response"]
    assert resp["content"] == "Hello world" and resp["reasoning"] == "hmm"
    assert resp["tool_calls"] == [{"id": "t0", "name": "f", "arguments": "{\"a\":1}"}]
    assert resp["dropped_tool_names"] == ["g"] and resp["usage"] == {"total_tokens": 9}
    # The done is the last event: the subscription ends with it.
    sent = sup.stats()
    assert sent["subscribed_calls"] == 0, sent
    # Idempotent: the same done event, nothing new published; no new attempt.
    assert sup.ok(C_FINISH, call, "failed", None, 2, None) == done
    assert sup.stats()["events_sent"] == sent["events_sent"], "a repeated finish sent an event"
    assert sup.request(C_AUTHORIZE, call, 2, False)[0] == R_REFUSED
    assert len(read_events_after(sink.db_path, call, 0)) == len(parts) + 1
    worker.send(delta(call, 1, len(parts) + 1))
    sup.wait_stats(lambda s: s["dropped_by_verdict"]["closed"] == 1, "the late delta's drop")


def test_finish_refuses_bad_meta_and_keeps_the_call_open(sink: SinkUnderTest) -> None:
    sink.sup.ok(C_AUTHORIZE, "c", 1, False)
    reply = sink.sup.request(C_FINISH, "c", "completed", None, 1, {"partial": "no"})
    assert reply[0] == R_REFUSED and "meta.partial" in reply[2]
    worker = sink.worker()
    worker.send(delta("c", 1, 1))
    assert sink.events("c", 1)[0]["data"] == "x"


# ---- subscribers: the events socket ------------------------------------------------

def test_a_listener_gets_the_replay_then_the_live_events_ending_with_the_done(
        sink: SinkUnderTest) -> None:
    call, sup = "follow", sink.sup
    sup.ok(C_AUTHORIZE, call, 1, False)  # the harness's listener follows it from seq 0
    worker = sink.worker()
    for seq in range(1, 6):
        worker.send(delta(call, 1, seq, f"d{seq};"))
    sink.events(call, 5)  # all five committed (an event is sent after its commit)
    late = sink.new_listener()
    sup.follow(call, late)  # from seq 0: the five stored ones, then the live ones
    mid = sink.new_listener()
    sup.follow(call, mid, from_seq=3)  # only what comes after seq 3
    for seq in range(6, 9):
        worker.send(delta(call, 1, seq, f"d{seq};"))
    worker.send(final(call, 1, 8))
    assert recv_ack(worker)[3] is True
    done = sup.ok(C_FINISH, call, "completed", None, 1, {"finish_reason": "stop"})
    assert done["op"] == "done" and done["seq"] == 9
    assert done["response"]["content"] == "".join(f"d{s};" for s in range(1, 9))

    got = late.events(call, 9)
    assert [(e["op"], e["seq"]) for e in got] == [("delta", s) for s in range(1, 9)] + [("done", 9)]
    assert [e["data"] for e in got[:-1]] == [f"d{s};" for s in range(1, 9)]
    assert got[-1] == done
    got_mid = mid.events(call, 6)
    assert [e["seq"] for e in got_mid] == list(range(4, 10)), "from_seq=3 must replay only > 3"
    assert got_mid[-1] == done
    assert [e["seq"] for e in sink.events(call, 4)] == list(range(6, 10))
    # Nothing else went to anyone, and the done ended every subscription.
    stats = sup.stats()
    assert stats["events_sent"] == 9 + 9 + 6, stats
    assert stats["subscribed_calls"] == 0 and stats["listens"] == 3, stats
    assert stats["events_unroutable"] == 0 and stats["events_dropped_full"] == 0, stats


@pytest.mark.parametrize("live", [False, True])
def test_a_subscription_to_an_ended_call_replays_the_store_after_from_seq(
        sink: SinkUnderTest, live: bool) -> None:
    """Ended at the sink: replayed from the transcript (whatever `live` says),
    the done last, and nothing is followed afterwards."""
    call, sup = "ended", sink.sup
    sup.ok(C_AUTHORIZE, call, 1, False)
    worker = sink.worker()
    for seq in range(1, 5):
        worker.send(delta(call, 1, seq, f"d{seq}"))
    sink.events(call, 4)
    done = sup.ok(C_FINISH, call, "completed", None, 1, {"finish_reason": "stop"})
    listener = sink.new_listener()
    reply = sup.subscribe(call, listener, from_seq=2, live=live)
    assert reply == [R_OK, reply[1], None], reply
    got = listener.events(call, 3)
    assert [e["seq"] for e in got] == [3, 4, 5] and [e["data"] for e in got[:2]] == ["d3", "d4"]
    assert got[-1] == done
    stats = sup.stats()
    assert stats["subscribed_calls"] == 0, "a subscription to an ended call outlived its replay"
    assert stats["events_sent"] == 5 + 3, stats


def test_from_now_replays_nothing_and_follows_the_new_events(sink: SinkUnderTest) -> None:
    call, sup = "now", sink.sup
    sup.ok(C_AUTHORIZE, call, 1, False)
    worker = sink.worker()
    for seq in range(1, 4):
        worker.send(delta(call, 1, seq, f"d{seq}"))
    sink.events(call, 3)  # stored
    listener = sink.new_listener()
    sup.follow(call, listener, from_seq=FROM_NOW)
    worker.send(delta(call, 1, 4, "d4"))
    # A replay would have been sent before the live event, on the same connection.
    _, first = listener.next(call, "the first event after subscribing from now")
    assert (first["seq"], first["data"]) == (4, "d4"), first
    assert sink.events(call, 1)[0]["seq"] == 4
    assert sup.stats()["events_sent"] == 3 + 1 + 1


def test_subscribing_to_a_call_with_nothing_stored_not_live_is_refused(
        sink: SinkUnderTest) -> None:
    sup = sink.sup
    reply = sup.subscribe("nothing-here", sink.listener, from_seq=0, live=False)
    assert reply[0] == R_REFUSED and reply[2].startswith("unknown_call"), reply
    # An authorized call that stored nothing yet is no different, not live.
    sup.ok(C_AUTHORIZE, "quiet", 1, False)
    reply = sup.subscribe("quiet", sink.new_listener(), from_seq=0, live=False)
    assert reply[0] == R_REFUSED and reply[2].startswith("unknown_call"), reply
    stats = sup.stats()
    assert stats["events_sent"] == 0 and stats["subscribed_calls"] == 1, stats  # the harness's


def test_every_event_a_listener_receives_is_already_in_the_transcript(
        sink: SinkUnderTest) -> None:
    """Durable before visible, for each kind of event: deltas, a reset, the done.
    Each event is looked up in transcript.db right after it is received."""
    call, sup = "durable", sink.sup
    sup.ok(C_AUTHORIZE, call, 1, False)
    worker = sink.worker()
    reader = TranscriptReader(sink.db_path)

    def check(count: int, what: str) -> list[str]:
        ops: list[str] = []
        for i in range(count):
            raw, event = sink.listener.next(call, f"{what} #{i + 1}")
            stored = reader.events_after(call, event["seq"] - 1)
            assert stored and stored[0] == raw, \
                f"event {event['seq']} ({event['op']}) was sent before its commit"
            ops.append(event["op"])
        return ops

    try:
        for seq in range(1, 151):
            worker.send(delta(call, 1, seq, f"{seq},"))
        assert check(150, "attempt 1's delta") == ["delta"] * 150
        sup.ok(C_AUTHORIZE, call, 2, True)
        for seq in range(1, 151):
            worker.send(delta(call, 2, seq, f"{seq};"))
        assert check(151, "the reset or attempt 2's delta") == ["reset"] + ["delta"] * 150
        sup.ok(C_FINISH, call, "completed", None, 2, {"finish_reason": "stop"})
        assert check(1, "the done") == ["done"]
    finally:
        reader.close()


def test_the_events_of_one_commit_reach_a_listener_as_one_batch(sink: SinkUnderTest) -> None:
    """200 deltas waiting when the sink wakes are committed together and sent as
    a few array frames, each element the stored event's exact bytes."""
    call, sup = "batched", sink.sup
    sup.ok(C_AUTHORIZE, call, 1, False)
    worker = sink.worker()
    os.kill(sink.proc.pid, signal.SIGSTOP)
    try:
        for seq in range(1, 201):
            worker.send(delta(call, 1, seq, f"{seq},"))
    finally:
        os.kill(sink.proc.pid, signal.SIGCONT)
    got = [sink.listener.next(call, f"delta #{i + 1}") for i in range(200)]
    assert [e["seq"] for _, e in got] == list(range(1, 201))
    assert sink.listener.frames <= 10, f"{sink.listener.frames} frames for 200 events"
    reader = TranscriptReader(sink.db_path)
    try:
        assert [raw for raw, _ in got] == reader.events_after(call, 0)
    finally:
        reader.close()


def test_the_runs_of_several_calls_in_one_commit_reach_their_listener_in_order(
        sink: SinkUnderTest) -> None:
    """Two calls' deltas interleaved while the sink is stopped: one commit holds
    a run of each; the listener following both gets every event once, each
    call's in seq order, in a few frames, each the stored event's bytes."""
    calls, sup = ["run-a", "run-b"], sink.sup
    for call in calls:
        sup.ok(C_AUTHORIZE, call, 1, False)
    worker = sink.worker()
    os.kill(sink.proc.pid, signal.SIGSTOP)
    try:
        for seq in range(1, 101):
            for call in calls:
                worker.send(delta(call, 1, seq, f"{call}{seq},"))
    finally:
        os.kill(sink.proc.pid, signal.SIGCONT)
    frames_before = sink.listener.frames
    got = {call: [sink.listener.next(call, f"{call} delta #{i + 1}") for i in range(100)]
           for call in calls}
    assert sink.listener.frames - frames_before <= 10, "one frame per commit, not per run"
    reader = TranscriptReader(sink.db_path)
    try:
        for call in calls:
            assert [e["seq"] for _, e in got[call]] == list(range(1, 101))
            assert [raw for raw, _ in got[call]] == reader.events_after(call, 0)
    finally:
        reader.close()


BAD_EVENTS_IN: list[tuple[list[bytes], str]] = [
    ([encode({"v": 1, "op": "subscribe", "call_id": "c"})], "unknown_op"),
    ([b"\xc1 not msgpack"], "bad_frame"),
    ([encode(["listen"])], "bad_message"),
    ([encode({"v": 2, "op": "listen"})], "unsupported_version"),
    ([LISTEN, b"a second frame"], "bad_frame"),
]


def test_the_events_socket_answers_anything_but_listen_with_an_error(
        sink: SinkUnderTest) -> None:
    sup = sink.sup
    listener = sink.new_listener()
    for parts, code in BAD_EVENTS_IN:
        listener.sock.send_multipart(parts)
        assert listener.sock.poll(int(WAIT_S * 1000)), f"no answer to {parts!r} within {WAIT_S}s"
        reply = msgpack.unpackb(listener.sock.recv())
        assert (reply["v"], reply["op"], reply["ref"], reply["code"]) == (1, "error", None, code), \
            (parts, reply)
        assert isinstance(reply["message"], str) and reply["message"], reply
    stats = sup.stats()
    assert stats["events_bad_input"] == len(BAD_EVENTS_IN), stats
    assert stats["listens"] == 2, stats  # the harness's listener and this one, once each
    # The sink keeps serving: `listen` is still answered, and events flow to this
    # connection and the others.
    listener.sock.send(LISTEN)
    assert listener.sock.poll(int(WAIT_S * 1000)), "no answer to listen after the errors"
    assert is_listening(msgpack.unpackb(listener.sock.recv()))
    sup.ok(C_AUTHORIZE, "after", 1, False)
    sup.follow("after", listener)
    sink.worker().send(delta("after", 1, 1, "still serving"))
    assert listener.events("after", 1)[0]["data"] == "still serving"
    assert sink.events("after", 1)[0]["data"] == "still serving"
    assert sup.stats()["events_bad_input"] == len(BAD_EVENTS_IN)
