"""The supervisor's owners in one process, without sockets or children: the call
and worker state machines, `decide`, the fall-backs, the SinkLink's typed
replies and subscriptions, the clients' listeners and waiters, and one call
driven end to end by the AttemptDriver against fake sockets."""

from __future__ import annotations

import random
import select
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from streamfence.config.model import DaemonConfig, ProviderProfile
from streamfence.protocol.codec import encode
from streamfence.protocol.errors import ErrorCode
from streamfence.protocol.internal import C_SUBSCRIBE, W_RUN
from streamfence.protocol.internal.control import (
    FROM_NOW,
    AddSubscriber,
    AttemptStats,
    Authorize,
    Ended,
    Fence,
    FinalRefused,
    Finish,
    FinishMeta,
    FollowedDone,
    ListenerOwner,
    Lost,
    Rebind,
    encode_ended,
    encode_final_refused,
    encode_ok,
    encode_refused,
    parse_control,
    stats_to_wire,
)
from streamfence.protocol.internal.outcome import AttemptError, AttemptOutcome, ErrorClass
from streamfence.protocol.internal.workers import (
    SpawnWorker,
    ZygoteCommand,
    go_frame,
    parse_run,
)
from streamfence.protocol.messages import (
    CallOptions,
    CallSpec,
    CallStatus,
    OnPartial,
    delta_event,
    done_event,
    reset_event,
)
from streamfence.protocol.states import CallState, FenceReason, WorkerState
from streamfence.sink.store import TranscriptStore
from streamfence.supervisor.attempts import AttemptDriver
from streamfence.supervisor.breaker import Breakers
from streamfence.supervisor.calls import (
    Call,
    CallEvent,
    InvalidTransition,
    Retry,
    decide,
    fence_error,
)
from streamfence.supervisor.calls import (
    Finish as Decision,
)
from streamfence.supervisor.clients import Clients
from streamfence.supervisor.fallbacks import Fallbacks
from streamfence.supervisor.journal import Journal
from streamfence.supervisor.pool import Pool
from streamfence.supervisor.sinklink import SINK_LOST, AttemptEvents, Refused, SinkLink
from streamfence.supervisor.timeouts import AttemptTimeouts
from streamfence.supervisor.worker_states import InvalidTransition as WorkerTransition
from streamfence.supervisor.worker_states import Worker, WorkerEvent
from streamfence.workers.liveness import LivenessTable

PROFILE = ProviderProfile(name="emu", kind="openai", base_url="http://127.0.0.1:1")
TIMEOUTS = AttemptTimeouts(first_chunk_s=5.0, stale_s=5.0, connect_s=1.0, read_s=5.0)


def make_call(on_partial: OnPartial = OnPartial.CONTINUE, max_attempts: int = 3,
              call_id: str = "c1") -> Call:
    spec = CallSpec(provider="emu", request={"model": "m", "messages": []},
                    options=CallOptions(on_partial=on_partial))
    return Call(call_id=call_id, owner="local", spec=spec, profile=PROFILE, timeouts=TIMEOUTS,
                max_attempts=max_attempts, deadline=None)


def state_of(call: Call) -> CallState:
    """The call's state (a function: callbacks change it behind mypy's narrowing)."""
    return call.state


class FakeSocket:
    """Records what is sent; `recv` hands out the frames queued in `inbox`."""

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.inbox: list[bytes] = []

    def send(self, frame: bytes, flags: int = 0) -> None:
        self.sent.append(frame)

    def send_multipart(self, parts: list[bytes], flags: int = 0, **options: Any) -> None:
        self.sent.append(parts)

    def recv(self, flags: int = 0) -> bytes:
        if not self.inbox:
            raise zmq.Again()
        return self.inbox.pop(0)

    def recv_multipart(self, flags: int = 0) -> list[bytes]:
        raise zmq.Again()


# ---- state machines ------------------------------------------------------------------

def test_call_transitions_and_the_error_names_state_and_event() -> None:
    call = make_call()
    for event, state in ((CallEvent.START, CallState.AUTHORIZING),
                         (CallEvent.AUTHORIZED, CallState.RUNNING),
                         (CallEvent.FENCE, CallState.FENCING), (CallEvent.RETRY, CallState.BACKOFF),
                         (CallEvent.BACKOFF_OVER, CallState.QUEUED)):
        call.to(event)
        assert call.state is state
    with pytest.raises(InvalidTransition, match="state queued got event 'finished'"):
        call.to(CallEvent.FINISHED)


def test_worker_transitions_and_the_error_names_state_and_event() -> None:
    worker = Worker(worker_id=7, slot=0)
    worker.to(WorkerEvent.HELLO)
    worker.to(WorkerEvent.RESERVE)
    assert worker.state is WorkerState.RESERVED
    with pytest.raises(WorkerTransition, match="worker 7 in state reserved got event 'idle'"):
        worker.to(WorkerEvent.IDLE)


# ---- decide ------------------------------------------------------------------------

TRANSIENT = AttemptError(ErrorClass.TRANSIENT, "stream_stalled", "no chunk")


@pytest.mark.parametrize("on_partial,visible,attempts,error,expect", [
    (OnPartial.CONTINUE, 0, 1, None, CallStatus.COMPLETED),
    (OnPartial.CONTINUE, 5, 1, TRANSIENT, CallStatus.PARTIAL),
    (OnPartial.RESTART, 5, 1, TRANSIENT, "retry"),
    (OnPartial.CONTINUE, 0, 1, TRANSIENT, "retry"),
    (OnPartial.CONTINUE, 0, 3, TRANSIENT, CallStatus.FAILED),
    (OnPartial.CONTINUE, 0, 1, AttemptError(ErrorClass.FINAL, "bad_request", "no"),
     CallStatus.FAILED),
    (OnPartial.CONTINUE, 5, 1, AttemptError(ErrorClass.CONTEXT_OVERFLOW, "ctx", "too long"),
     CallStatus.FAILED),
])
def test_decide(on_partial: OnPartial, visible: int, attempts: int,
                error: AttemptError | None, expect: Any) -> None:
    call = make_call(on_partial)
    call.attempts = attempts
    outcome = AttemptOutcome(ok=error is None, finish_reason="stop", error=error)
    decision = decide(call, AttemptStats(1, visible_chars=visible), outcome, error, 0.0)
    if expect == "retry":
        assert isinstance(decision, Retry)
        return
    assert isinstance(decision, Decision) and decision.status is expect
    if expect is CallStatus.PARTIAL:
        assert decision.meta.partial and decision.meta.finish_reason == "length"
    if expect is CallStatus.FAILED and attempts == 3:
        assert decision.error == {"code": ErrorCode.STREAM_STALLED.value,
                                  "message": "3 attempt(s) failed; last: no chunk"}


def test_fence_errors_are_transient_with_their_code() -> None:
    error = fence_error(FenceReason.STALE, 2.5)
    assert (error.error_class, error.code) == (ErrorClass.TRANSIENT, "stream_stalled")
    assert "2.5s" in error.message
    assert {fence_error(r, 1.0).code for r in FenceReason} >= {"worker_died", "cancelled"}


# ---- fall-backs --------------------------------------------------------------------------

def test_fallbacks_switch_to_non_streaming_and_probe_once_per_window() -> None:
    now = [100.0]
    fb = Fallbacks(lambda: now[0])
    refused = AttemptError(ErrorClass.FINAL, "streaming_unsupported", "no streaming")
    adjusted = fb.adjust("p", refused, 0, {})
    assert adjusted.error.error_class is ErrorClass.TRANSIENT and adjusted.error.retry_after_s == 0
    assert not fb.streaming("p") and fb.streaming("q")
    five_xx = AttemptError(ErrorClass.TRANSIENT, "server_error", "boom", status=502)
    assert fb.adjust("q", five_xx, 0, {}).probe_next
    assert not fb.adjust("q", five_xx, 0, {}).probe_next  # once per window
    now[0] += 61.0
    assert fb.adjust("q", five_xx, 0, {}).probe_next
    assert not fb.adjust("q", five_xx, 3, {}).probe_next  # deltas came: no probe
    fb.learn("r", AttemptOutcome(ok=True, stream_options_rejected=True))
    assert not fb.include_usage("r") and fb.include_usage("q")


# ---- the sink link -----------------------------------------------------------------------

class Attempts(AttemptEvents):
    """The attempt endings the SinkLink hands on, in order."""

    def __init__(self) -> None:
        self.seen: list[Ended | FinalRefused | Lost | FollowedDone] = []

    def on_ended(self, ended: Ended) -> None:
        self.seen.append(ended)

    def on_final_refused(self, refused: FinalRefused) -> None:
        self.seen.append(refused)

    def on_lost(self, lost: Lost) -> None:
        self.seen.append(lost)

    def on_followed_done(self, done: FollowedDone) -> None:
        self.seen.append(done)


def test_sinklink_typed_replies_attempt_endings_and_lost_requests() -> None:
    sock = FakeSocket()
    link = SinkLink(sock, time.monotonic)  # type: ignore[arg-type]
    replies: list[Any] = []
    link.authorize("c", 2, False, "m", replies.append)
    link.fence("c", 2, replies.append)
    link.finish("c", CallStatus.COMPLETED, None, 2, FinishMeta(), replies.append)
    sent = [parse_control(msgpack.unpackb(f)) for f in sock.sent]
    assert sent[0] == Authorize(1, "c", 2, False, "m") and sent[1] == Fence(2, "c", 2)
    stats = AttemptStats(1, accepted=3, visible_chars=2, last_seq=3, closed=True)
    outcome = AttemptOutcome(ok=True, finish_reason="stop", usage={"total_tokens": 3})
    sock.inbox += [encode_ok(1, stats_to_wire(stats)), encode_refused(2, "stale_epoch: x"),
                   encode_ended("c", 2, stats, outcome), encode_final_refused("c", 1, "late"),
                   encode([30, "c", 1, b"e1"]),  # the retired E_EVENT tag: junk now
                   encode([99, "junk"]), encode_ok(77, None)]  # a reply to no request
    attempts = Attempts()
    assert link.drain(attempts) == 7
    assert replies == [stats, Refused("stale_epoch: x")]
    assert attempts.seen == [Ended("c", 2, stats, outcome), FinalRefused("c", 1, "late")]
    link.fail_pending()  # the sink died before answering the finish
    assert replies[-1] is SINK_LOST and len(replies) == 3


LISTENER = "0123456789abcdef0123456789abcdef"


def test_sinklink_subscribe_sends_add_subscriber_and_delivers_its_reply() -> None:
    sock = FakeSocket()
    link = SinkLink(sock, time.monotonic)  # type: ignore[arg-type]
    answers: dict[str, list[Any]] = {"ok": [], "refused": [], "lost": []}
    bob = ListenerOwner("bob", 64, 1024)
    link.subscribe("c1", LISTENER, 0, True, bob, answers["ok"].append)
    link.subscribe("c2", LISTENER, 3, False, bob, answers["refused"].append)
    link.subscribe("c3", LISTENER, FROM_NOW, True, bob, answers["lost"].append)
    raw = [msgpack.unpackb(f) for f in sock.sent]
    # the wire layout itself
    assert raw[0] == [C_SUBSCRIBE, 1, "c1", LISTENER, 0, True, ["bob", 64, 1024]]
    assert [parse_control(m) for m in raw] == [
        AddSubscriber(1, "c1", LISTENER, 0, True, bob),
        AddSubscriber(2, "c2", LISTENER, 3, False, bob),
        AddSubscriber(3, "c3", LISTENER, -1, True, bob)]
    sock.inbox += [encode_refused(2, "no events of c2"), encode_ok(1, None)]
    assert link.drain(Attempts()) == 2
    assert answers["ok"] == [None] and answers["refused"] == [Refused("no events of c2")]
    assert answers["lost"] == []  # still waiting for the sink
    link.fail_pending()
    assert answers["lost"] == [SINK_LOST]
    link.fail_pending()  # answered once: nothing is pending any more
    assert answers == {"ok": [None], "refused": [Refused("no events of c2")], "lost": [SINK_LOST]}


# ---- the clients' listeners and waiters ------------------------------------------------------

def test_clients_follow_listeners_and_answer_waiters() -> None:
    sock = FakeSocket()
    clients = Clients(sock, Counter())  # type: ignore[arg-type]
    a, b = ListenerOwner("a"), ListenerOwner("b")
    clients.follow("c", "listener-a-0000000", a)
    clients.follow("c", "listener-b-0000000", b)
    clients.follow("c", "listener-a-0000000", a)  # once per listener
    clients.follow("d", "listener-a-0000000", a)
    clients.follow("e", "listener-b-0000000", b)
    clients.unfollow("e", "listener-b-0000000")  # the sink refused it
    assert sorted(clients.following(), key=str) == [("c", "listener-a-0000000", a),
                                                    ("c", "listener-b-0000000", b),
                                                    ("d", "listener-a-0000000", a)]
    assert sock.sent == []  # the events go from the sink, never through here
    clients.wait_result("c", b"w1", "r1", until=10.0)
    clients.wait_result("c", b"w2", "r2", until=20.0)
    clients.expire_waiters(15.0)
    (identity, frame), = sock.sent
    assert identity == b"w1" and msgpack.unpackb(frame)["op"] == "pending"
    sock.sent.clear()
    asked: list[str] = []

    def diagnostics() -> list[dict[str, Any]]:
        asked.append("c")
        return [{"attempt": 1}]

    clients.on_call_done("c", {"op": "done", "status": "completed"}, diagnostics)
    (identity, frame), = sock.sent
    assert identity == b"w2" and msgpack.unpackb(frame) == {
        "op": "done", "status": "completed", "ref": "r2", "diagnostics": [{"attempt": 1}]}
    assert asked == ["c"]
    assert clients.following() == [("d", "listener-a-0000000", a)]  # c ended: nobody follows it


# ---- one call through the AttemptDriver ------------------------------------------------------

@pytest.fixture
def parts(tmp_path: Path) -> Iterator[dict[str, Any]]:
    live = LivenessTable(str(tmp_path / "live.bin"), 4, create=True)
    journal = Journal(str(tmp_path / "journal.db"))
    zygote: list[ZygoteCommand] = []
    workers, sink_sock, client_sock = FakeSocket(), FakeSocket(), FakeSocket()
    pool = Pool(zygote.append, workers, live, slots=4, spare=1,  # type: ignore[arg-type]
                max_workers=4)
    clients = Clients(client_sock, Counter())  # type: ignore[arg-type]
    sink = SinkLink(sink_sock, time.monotonic)  # type: ignore[arg-type]
    counters: Counter[str] = Counter()
    transcript = str(tmp_path / "transcript.db")
    TranscriptStore(transcript, background_checkpoints=False).close()  # the sink makes it
    driver = AttemptDriver(DaemonConfig(providers={"emu": PROFILE}), journal, pool, sink,
                           clients, Breakers(5, 60.0, time.monotonic), counters,
                           time.monotonic, random.Random(1), transcript)
    yield {"transcript": transcript, "pool": pool, "zygote": zygote, "workers": workers, "sink": sink,
           "sink_sock": sink_sock, "clients": clients, "client_sock": client_sock,
           "driver": driver, "journal": journal, "counters": counters}
    journal.close()
    live.close()


def test_one_call_authorize_dispatch_end_finish(parts: dict[str, Any]) -> None:
    pool, driver, sink_sock = parts["pool"], parts["driver"], parts["sink_sock"]
    pool.maintain()
    spawn = parts["zygote"][0]
    assert isinstance(spawn, SpawnWorker)
    pool.on_spawned(spawn.worker_id, 0)  # pid 0: never a real kill
    pool.on_hello(spawn.worker_id, 0)
    call = make_call()
    parts["journal"].add_call(call.call_id, "local", None, None, "emu", call.spec.request, {})
    driver.enqueue(call)
    _schedule(parts)
    # The worker prepares the attempt while it is authorized (W_RUN at the schedule) ...
    (identity, frame), = parts["workers"].sent
    run = parse_run(frame)
    assert msgpack.unpackb(frame)[0] == W_RUN and identity == b"w%d" % spawn.worker_id
    assert (run.call_id, run.attempt, run.settings.streaming) == ("c1", 1, True)
    authorize = parse_control(msgpack.unpackb(sink_sock.sent.pop()))
    assert authorize == Authorize(1, "c1", 1, False, "m") and call.state is CallState.AUTHORIZING
    sink_sock.inbox.append(encode_ok(1, stats_to_wire(AttemptStats(0))))
    parts["sink"].drain(driver)
    # ... and sends it once the sink has authorized it (W_GO).
    assert parts["workers"].sent[1:] == [[identity, go_frame(run.token)]]
    stats = AttemptStats(1, accepted=1, visible_chars=2, last_seq=1, closed=True)
    outcome = AttemptOutcome(ok=True, finish_reason="stop", model="m")
    sink_sock.inbox.append(encode_ended("c1", 1, stats, outcome))
    parts["sink"].drain(driver)
    finish = parse_control(msgpack.unpackb(sink_sock.sent.pop()))
    assert isinstance(finish, Finish) and finish.status is CallStatus.COMPLETED
    assert finish.meta.finish_reason == "stop" and state_of(call) is CallState.FINISHING
    done = done_event("c1", 2, CallStatus.COMPLETED, None, None, 1)
    sink_sock.inbox.append(encode_ok(finish.req, [done, []]))  # the done, no refusals
    parts["sink"].drain(driver)
    assert not driver.calls.has("c1") and parts["counters"]["calls_completed"] == 1
    assert parts["journal"].is_finished("c1")  # the done event itself is the sink's to store
    assert parts["client_sock"].sent == []  # no waiter; the events went from the sink
    assert parts["journal"].attempts_of("c1")[0]["how"] == "ended"


def _schedule(parts: dict[str, Any]) -> None:
    """Schedule, and let the journal's sync (which the authorization waits for) come."""
    parts["driver"].schedule()
    journal = parts["journal"]
    readable, _, _ = select.select([journal.sync_fileno()], [], [], 10.0)
    assert readable, "the journal was not synced within 10 s"
    journal.on_synced()


def _synced(journal: Journal) -> None:
    """The journal's sync thread says it synced; the loop runs what waited for it."""
    readable, _, _ = select.select([journal.sync_fileno()], [], [], 10.0)
    assert readable, "the journal was not synced within 10 s"
    journal.on_synced()


def _new_worker(parts: dict[str, Any]) -> None:
    """A worker forked for a waiting call, ready (the spares would wait)."""
    before = len(parts["zygote"])
    parts["pool"].maintain(demand=1)
    assert len(parts["zygote"]) == before + 1
    spawn = parts["zygote"][-1]
    assert isinstance(spawn, SpawnWorker)
    parts["pool"].on_spawned(spawn.worker_id, 0)  # pid 0: never a real kill
    parts["pool"].on_hello(spawn.worker_id, 0)


@pytest.mark.parametrize("first", ["sink", "journal"])
def test_a_retry_is_authorized_while_its_epoch_syncs_and_goes_once_both_hold_it(
        parts: dict[str, Any], first: str) -> None:
    """A first attempt: nothing reaches the sink before the journal's sync (the
    call's row commits with its epoch). A retry: its authorize goes at the
    schedule, while the journal syncs its epoch, and W_GO only once the sink
    has answered and the journal has synced, whichever comes first."""
    driver, journal, sink_sock, workers = (parts["driver"], parts["journal"],
                                           parts["sink_sock"], parts["workers"])
    _new_worker(parts)
    call = make_call()
    journal.add_call(call.call_id, "local", None, None, "emu", call.spec.request, {})
    driver.enqueue(call)
    driver.schedule()
    assert sink_sock.sent == [], "a first attempt's authorize went before its call was durable"
    _synced(journal)
    first_authorize = parse_control(msgpack.unpackb(sink_sock.sent.pop()))
    assert isinstance(first_authorize, Authorize) and first_authorize.attempt == 1
    sink_sock.inbox.append(encode_ok(1, stats_to_wire(AttemptStats(0))))
    parts["sink"].drain(driver)
    assert call.state is CallState.RUNNING
    driver.on_worker_exit("c1", call.token, -9)  # the attempt's worker died
    fence = parse_control(msgpack.unpackb(sink_sock.sent.pop()))
    assert isinstance(fence, Fence)
    sink_sock.inbox.append(encode_ok(fence.req, stats_to_wire(AttemptStats(1, closed=True))))
    parts["sink"].drain(driver)
    driver.on_timers(time.monotonic() + 60.0)  # its backoff is over
    assert state_of(call) is CallState.QUEUED
    _new_worker(parts)
    workers.sent.clear()
    driver.schedule()
    authorize = parse_control(msgpack.unpackb(sink_sock.sent.pop()))
    assert isinstance(authorize, Authorize) and authorize.attempt == 2
    (identity, frame), = workers.sent  # W_RUN: the worker prepares
    run = parse_run(frame)
    if first == "sink":
        sink_sock.inbox.append(encode_ok(authorize.req, stats_to_wire(AttemptStats(0))))
        parts["sink"].drain(driver)
        assert len(workers.sent) == 1, "W_GO before the journal synced the retry's epoch"
        _synced(journal)
    else:
        _synced(journal)
        assert len(workers.sent) == 1, "W_GO before the sink authorized the retry"
        sink_sock.inbox.append(encode_ok(authorize.req, stats_to_wire(AttemptStats(0))))
        parts["sink"].drain(driver)
    assert workers.sent[1:] == [[identity, go_frame(run.token)]]
    assert state_of(call) is CallState.RUNNING and call.epoch == 2
    assert [a["attempt"] for a in journal.attempts_of("c1")] == [1, 2]


def _running_call(parts: dict[str, Any]) -> Call:
    pool, driver, sink_sock = parts["pool"], parts["driver"], parts["sink_sock"]
    pool.maintain()
    spawn = parts["zygote"][0]
    pool.on_spawned(spawn.worker_id, 0)  # pid 0: the kill is a no-op
    pool.on_hello(spawn.worker_id, 0)
    call = make_call()
    parts["journal"].add_call(call.call_id, "local", None, None, "emu", call.spec.request, {})
    driver.enqueue(call)
    _schedule(parts)
    sink_sock.inbox.append(encode_ok(1, stats_to_wire(AttemptStats(0))))
    parts["sink"].drain(driver)
    assert call.state is CallState.RUNNING and call.epoch == 1
    return call


def _sink_restart(parts: dict[str, Any]) -> Rebind:
    """The sink died: the driver rebinds; once the new epoch is synced, the
    rebind goes to the sink (returned)."""
    parts["driver"].on_sink_restart()
    journal = parts["journal"]
    readable, _, _ = select.select([journal.sync_fileno()], [], [], 10.0)
    assert readable, "the journal was not synced within 10 s"
    journal.on_synced()
    op = parse_control(msgpack.unpackb(parts["sink_sock"].sent[-1]))
    assert isinstance(op, Rebind)
    return op


def test_sink_restart_rebinds_the_running_attempt_under_a_new_epoch(
        parts: dict[str, Any]) -> None:
    """The worker keeps its stream: no fence, no kill, no retry; a new epoch,
    durable before the sink hears of it, for the same provider attempt."""
    call = _running_call(parts)
    worker = parts["pool"].get(call.worker_id)
    op = _sink_restart(parts)
    assert (op.call_id, op.attempt, op.from_attempt, op.content_from, op.token) == \
        ("c1", 2, 1, 1, call.token)
    assert state_of(call) is CallState.RUNNING and call.epoch == 2 and call.attempts == 1
    attempts = parts["journal"].attempts_of("c1")
    assert [(a["attempt"], a["how"]) for a in attempts] == [(1, "rebound"), (2, None)]
    parts["sink_sock"].inbox.append(encode_ok(op.req, stats_to_wire(
        AttemptStats(2, accepted=7, last_seq=7))))
    parts["sink"].drain(parts["driver"])
    assert state_of(call) is CallState.RUNNING and parts["counters"]["attempts_rebound"] == 1
    assert worker.state is WorkerState.BUSY and parts["counters"]["retries"] == 0


def test_a_refused_rebind_fences_the_attempt(parts: dict[str, Any]) -> None:
    call = _running_call(parts)
    op = _sink_restart(parts)
    parts["sink_sock"].inbox.append(encode_refused(op.req, "stale_epoch: no"))
    parts["sink"].drain(parts["driver"])
    fence = parse_control(msgpack.unpackb(parts["sink_sock"].sent[-1]))
    assert isinstance(fence, Fence) and fence.attempt == 2
    assert call.fence_reason is FenceReason.SINK_RESTARTED


DELTAS = [("c1", "delta", "Hel"), ("c1", "delta", "lo")]


@pytest.mark.parametrize(("stored", "partial"), [
    (DELTAS, True),
    ([*DELTAS, ("c1", "reset", "")], False),  # a reset: nothing of them is shown any more
    ([("other", "delta", "not c1's")], False),
    ([], False),
], ids=["text-shown", "text-reset", "another-call", "nothing"])
def test_a_sink_restart_counts_what_the_transcript_holds_of_the_attempt(
        parts: dict[str, Any], stored: list[tuple[str, str, str]], partial: bool) -> None:
    """Without the sink's answer (a rebind refused, then the sink lost again
    before it answered the fence), the fenced attempt's stats come from the
    transcript, counting every epoch of the answer: visible text makes a
    `continue` call partial; without any, it is retried."""
    sink_sock = parts["sink_sock"]
    call = _running_call(parts)
    store = TranscriptStore(parts["transcript"], background_checkpoints=False)
    seqs: Counter[str] = Counter()
    for call_id, kind, text in stored:
        seqs[call_id] += 1
        seq = seqs[call_id]
        if kind == "reset":
            store.add(call_id, seq, seq, 1, "reset", encode(reset_event(call_id, 1, seq)))
        else:
            store.add_run(call_id, seq, 1, [encode(delta_event(call_id, 1, seq, "text", text))])
    store.commit()
    store.close()
    op = _sink_restart(parts)
    sink_sock.inbox.append(encode_refused(op.req, "stale_epoch: no"))
    parts["sink"].drain(parts["driver"])  # a fence of epoch 2 goes out
    sent_before = len(sink_sock.sent)
    parts["sink"].fail_pending()  # ... and its answer never comes
    assert [a["how"] for a in parts["journal"].attempts_of("c1")] == ["rebound",
                                                                       "sink_restarted"]
    if partial:
        finish = parse_control(msgpack.unpackb(sink_sock.sent[-1]))
        assert isinstance(finish, Finish) and finish.status is CallStatus.PARTIAL
        assert state_of(call) is CallState.FINISHING and parts["counters"]["retries"] == 0
    else:
        assert len(sink_sock.sent) == sent_before  # nothing to finish: a retry
        assert state_of(call) is CallState.BACKOFF and parts["counters"]["retries"] == 1


def test_a_second_sink_death_before_the_first_rebind_is_durable_rebinds_once(
        parts: dict[str, Any]) -> None:
    """Issue 28, defect 1: the sink dies again while the first rebind's new
    epoch is not yet durable (its C_REBIND not sent). Only the newest epoch is
    rebound, from the one before it: a rebind from the first epoch to the
    newest too would be refused by the sink as stale (same epoch twice), and
    that refusal fences the attempt: a second provider request."""
    call = _running_call(parts)
    sent_before = len(parts["sink_sock"].sent)
    parts["driver"].on_sink_restart()  # epoch 2 journaled, its commit in flight
    parts["driver"].on_sink_restart()  # and the sink dies again: epoch 3
    journal = parts["journal"]
    readable, _, _ = select.select([journal.sync_fileno()], [], [], 10.0)
    while readable:  # every commit durable, its callbacks run
        journal.on_synced()
        readable, _, _ = select.select([journal.sync_fileno()], [], [], 0.5)
    rebinds = [op for op in (parse_control(msgpack.unpackb(frame))
                             for frame in parts["sink_sock"].sent[sent_before:])
               if isinstance(op, Rebind)]
    assert [(op.attempt, op.from_attempt, op.content_from) for op in rebinds] == [(3, 2, 1)]
    assert call.epoch == 3 and state_of(call) is CallState.RUNNING
