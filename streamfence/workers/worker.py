"""The worker process: runs one attempt at a time, streams its deltas to the
sink, and ends every attempt with an explicit final message.

Duties:
1. Say hello to the supervisor, then wait for a W_RUN.
2. Prepare the attempt (its request, client and SDK request) and send
   nothing to the provider or the sink before the supervisor's W_GO, which
   comes once the sink authorized it; on W_DROP, go back to waiting
   unseen (workers/send_gate.py).
3. Stamp the attempt on every log record (streamfence.protocol.logs), run the attempt
   through its profile's adapter (workers/registry.py), and push each delta to the
   sink as (call, attempt, seq, kind, data) with seq contiguous from 1, over
   one stream connection (workers/sink_channel.py); the deltas of one
   provider read in one write, before the next read (`SinkOutput.reads`).
4. Touch the liveness row on every real chunk (streamfence.workers.liveness).
5. Send T_FINAL with the last seq and the outcome, and count the attempt done
   only when the sink acknowledges it (a stream's end proves nothing; a PUSH
   that exits right after sending loses messages). No ack in time: exit with
   ExitCode.SINK_UNREACHABLE so the supervisor treats the attempt as incomplete.
6. Report W_IDLE and wait for the next attempt.

Its process title (`ps`) says which attempt it runs: `streamfence[NAME]: worker 3
(call 1a2b3c4d…, attempt 2)`, or `streamfence[NAME]: worker 3 (idle)`.

The worker never decides retries: a stale or superseded worker is killed by
the supervisor and, even if it lived on, its deltas carry a fenced epoch.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any, NoReturn, TypeVar

import zmq

from streamfence.protocol.failpoints import ARMED, failpoint
from streamfence.protocol.internal import Endpoints
from streamfence.protocol.internal.checks import BadFrame
from streamfence.protocol.internal.outcome import (
    AttemptDiag,
    AttemptError,
    AttemptOutcome,
    outcome_to_wire,
)
from streamfence.protocol.internal.worker_wire import (
    FinalAck,
    RebindTo,
    delta_frame,
    final_frame,
    hello_frame,
    parse_sink_reply,
)
from streamfence.protocol.internal.workers import (
    RunAttempt,
    idle_frame,
    parse_run,
    parse_word,
    worker_hello_frame,
)
from streamfence.protocol.lifecycle import ExitCode, set_process_title
from streamfence.protocol.logs import clear_context, request_model, route_logs_to, set_context
from streamfence.protocol.messages import DeltaKind, submitted_request, visible_chars
from streamfence.workers.errors import UNEXPECTED_CODES, traceback_text
from streamfence.workers.liveness import LivenessTable
from streamfence.workers.registry import run_attempt
from streamfence.workers.send_gate import GATE, AttemptDropped
from streamfence.workers.sink_channel import LOST, SinkChannel
from streamfence.workers.warmup import warm_spare

log = logging.getLogger("streamfence.worker")

NOTICE = DeltaKind.NOTICE.value


T = TypeVar("T")
KEEP_FOR_REBIND_BYTES = 32 << 20  # an answer's frames kept to send again after a sink restart
FIRST_ANSWER_WAIT_S = 0.25  # the first delta waits this long for the start hello's answer


class SinkOutput:
    """The AttemptOutput of one attempt: owns its seq counter and pushes each delta
    to the sink (the per-delta hot path); touches the liveness row per chunk.

    It says T_HELLO first, before the provider is asked, and holds its deltas
    until the T_REBIND answer says under which attempt number to write: its
    own, unless the sink it reaches restarted after authorizing it and was
    told to rebind it (ARCHITECTURE §2.8). It keeps the attempt's deltas (up
    to KEEP_FOR_REBIND_BYTES encoded) so that, when the sink dies mid-stream,
    it can go on at the restarted one the same way: T_HELLO first on the new
    connection, then the deltas after the seq the answer names. Answered 0,
    or with the deltas not kept, it is `over`: it writes nothing more and
    the supervisor ends it.

    Within `reads` (the provider's body reads, passed through) the deltas
    parsed from one read are held and written in one piece when the adapter
    asks for the next read, before it blocks: one write and one wake-up of
    the sink per read rather than per delta, and no delta waits for the
    provider (a delta after an idle gap goes out as soon as its read is
    parsed; docs/PERFORMANCE.md, issue 32: wake-ups)."""

    __slots__ = ("_call_id", "_chan", "_first_wait_s", "_held", "_holding", "_kept",
                 "_kept_bytes", "_live", "_rebinding", "_send", "_slot", "_token", "attempt",
                 "exc", "first_chunk_ns", "over", "seq", "visible")

    def __init__(self, sink: SinkChannel, call_id: str, attempt: int, token: int,
                 live: LivenessTable, slot: int) -> None:
        self._chan = sink
        self._send = sink.send
        self._call_id = call_id
        self._token = token
        self.attempt = attempt
        self._live = live
        self._slot = slot
        self._kept: list[tuple[str, Any]] | None = []
        self._kept_bytes = 0
        self.over = False
        self.seq = 0
        self.visible = False  # any visible text yet (the failure line says so)
        self.first_chunk_ns = 0
        self.exc: BaseException | None = None
        self._holding = False  # inside `reads`: frames wait in _held for the read's end
        self._held: list[bytes] = []
        self._first_wait_s = FIRST_ANSWER_WAIT_S
        self._rebinding = False  # a T_HELLO is out, its answer not in yet

    def begin(self) -> None:
        """The start hello, once the attempt is authorized (its W_GO): its answer
        is in long before the provider's first chunk, so the first delta
        rarely waits (and never past _first_wait_s)."""
        self._chan.lost = False  # what broke before this attempt concerns no one
        self._rebinding = True
        self._send(hello_frame(self._call_id, self.attempt, self._token))

    def chunk(self, nbytes: int) -> None:
        if not self.first_chunk_ns:
            self.first_chunk_ns = time.monotonic_ns()
        self._live.touch(self._slot, nbytes)

    def delta(self, kind: str, data: Any) -> None:
        seq = self.seq = self.seq + 1
        if not self.visible and visible_chars(kind, data):
            self.visible = True
        frame = delta_frame(self._call_id, self.attempt, seq, kind, data)
        kept = self._kept
        if kept is not None:
            kept.append((kind, data))
            self._kept_bytes += len(frame)
            if self._kept_bytes > KEEP_FOR_REBIND_BYTES:
                self._kept = None
        if self._rebinding or self._chan.lost or self.over:
            wait_s, self._first_wait_s = self._first_wait_s, 0.0
            self._go_on(wait_s)  # held: sent once the sink answers the hello
            return
        if self._holding:
            self._held.append(frame)
            return
        self._send(frame)

    def failed(self, exc: BaseException) -> None:
        self.exc = exc

    def reads(self, reads: Iterable[bytes]) -> Iterator[bytes]:
        """The provider's reads; what each one's deltas wrote goes out in one
        piece before the next read (class docstring)."""
        self._holding = True
        try:
            for data in reads:
                yield data
                self._write_held()
        finally:
            self._holding = False
            self._write_held()

    def _write_held(self) -> None:
        held = self._held
        if held:
            # Frames held only while the connection was fine (delta()); if it
            # broke since, the deltas go again from _kept after the hello.
            self._send(held[0] if len(held) == 1 else b"".join(held))
            held.clear()

    def _go_on(self, wait_s: float = 0.0) -> None:
        """While a hello is out (or after a lost connection: say hello again),
        once the sink answers send the held deltas under the attempt it names
        (or stop)."""
        chan = self._chan
        while not self.over:
            if chan.lost:
                chan.lost = False
                if self._kept is None:
                    log.warning("the sink went away mid-stream and this answer is over %d MiB "
                                "(not kept to send again): the attempt cannot go on",
                                KEEP_FOR_REBIND_BYTES >> 20)
                    self.over = True
                    return
                self._rebinding = True
                self._send(hello_frame(self._call_id, self.attempt, self._token))
            if not self._rebinding:
                return
            reply = chan.wait_reply(wait_s)
            if reply is None:
                return  # not answered yet: the deltas wait
            if reply is LOST:
                continue
            try:
                answer = parse_sink_reply(reply)
            except BadFrame:
                continue
            if not (type(answer) is RebindTo and answer.call_id == self._call_id
                    and answer.attempt == self.attempt):
                continue  # not for this attempt (an ack of an earlier one)
            self._rebinding = False
            new_attempt, after = answer.new_attempt, answer.resume_after
            if not new_attempt or self._kept is None or after > self.seq:
                log.warning("the restarted sink ended this attempt: it writes nothing more")
                self.over = True
                return
            if new_attempt != self.attempt:
                log.info("the sink restarted: attempt %d goes on as attempt %d after seq %d",
                         self.attempt, new_attempt, after)
                self.attempt = new_attempt
                if ARMED:
                    failpoint("worker.after_rebind")
            for seq in range(after + 1, self.seq + 1):
                if chan.lost:
                    break  # the sink died again: its successor hears the hello first
                kind, data = self._kept[seq - 1]
                self._send(delta_frame(self._call_id, new_attempt, seq, kind, data))

    def finish(self, outcome: list[Any], timeout_s: float) -> bool:
        """Send the final message and wait for its ack (over a sink restart
        too: the final goes again under the attempt number that goes on).
        False if the sink refused it or the attempt is over; no ack within
        `timeout_s`: exit with ExitCode.SINK_UNREACHABLE."""
        deadline = time.monotonic() + timeout_s
        self._holding = False  # an adapter that stopped reading early left its reads open
        self._write_held()
        while True:
            self._go_on(max(0.0, deadline - time.monotonic()))
            if self.over:
                return False
            if not self._rebinding:
                if not (ARMED and failpoint("worker.before_final")):  # drop: the final is lost
                    self._send(final_frame(self._call_id, self.attempt, self.seq, outcome))
                accepted = self._wait_ack(deadline)
                if accepted is not LOST:
                    return bool(accepted)
            elif time.monotonic() >= deadline:
                self._no_ack()

    def _wait_ack(self, deadline: float) -> object:
        """The final's ack (True/False), or LOST if the connection broke first."""
        while True:
            reply = self._chan.wait_reply(max(0.0, deadline - time.monotonic()))
            if reply is None:
                self._no_ack()
            if reply is LOST:
                return LOST
            answer = parse_sink_reply(reply)  # BadFrame: our own sink is broken (a crash)
            if type(answer) is FinalAck and answer.call_id == self._call_id \
                    and answer.attempt == self.attempt:
                if not answer.accepted:
                    log.warning("sink refused the final message: %s", answer.reason)
                return answer.accepted

    @staticmethod
    def _no_ack() -> NoReturn:
        log.error("no ack from the sink for the final message within final_ack_timeout_s; "
                  "exiting")
        logging.shutdown()
        os._exit(ExitCode.SINK_UNREACHABLE)


def _failed(outcome: AttemptOutcome, error: AttemptError, out: SinkOutput) -> AttemptOutcome:
    """Log the attempt's failure in one WARNING line, without a traceback: the
    supervisor logs the call's final failure, once, at ERROR (ARCHITECTURE
    §4.9). The traceback of an exception no rule recognised travels in the
    outcome to that line; another exception's (an SDK's status error, a
    dropped connection: the line says it all) is logged here at DEBUG only."""
    log.warning("stream failed %s: %s (%s, %s)",
                "after visible text" if out.visible else "before delivery", error.described,
                error.error_class.value, error.code, extra={"fields": {"code": error.code}})
    exc = out.exc
    if exc is None:
        return outcome
    if error.code in UNEXPECTED_CODES:
        return replace(outcome, error=replace(error, traceback=traceback_text(exc)))
    if log.isEnabledFor(logging.DEBUG):
        log.debug("where the attempt's exception was raised:\n%s", traceback_text(exc))
    return outcome


def _receive(ctl: zmq.Socket[bytes], parse: Callable[[bytes], T]) -> T:
    """The supervisor's next message that `parse` takes (anything else is logged)."""
    while True:
        try:
            return parse(ctl.recv())
        except BadFrame as exc:
            log.warning("unexpected message from the supervisor: %s", exc.reason)


def _word_on(ctl: zmq.Socket[bytes], token: int) -> Callable[[], bool]:
    """The supervisor's word on the prepared attempt `token` (True: W_GO)."""
    def word() -> bool:
        while True:
            said = _receive(ctl, parse_word)
            if said.token == token:
                return said.go
    return word


def _run_one(run: RunAttempt, ctl: zmq.Socket[bytes], sink: SinkChannel, live: LivenessTable,
             slot: int) -> bool | None:
    """Prepare the attempt, run it once its W_GO came (workers/send_gate.py);
    whether the sink accepted its final, or None: dropped (W_DROP), unseen."""
    settings = run.settings
    out = SinkOutput(sink, run.call_id, run.attempt, run.token, live, slot)
    request = run.request
    if run.request_file is not None:  # a large request: its submit frame, as stored
        with open(run.request_file, "rb") as f:
            request = submitted_request(f.read(), run.request)
    provider, model = run.profile.get("name"), request_model(request)
    set_context(run.session_id, run.call_id, run.attempt, run.owner, provider, model)
    started = 0

    def go() -> None:
        nonlocal started
        started = time.monotonic_ns()
        live.begin(slot, run.token)
        out.begin()
        log.info("attempt started: provider=%s model=%s", provider, model)
        if settings.notice:
            out.delta(NOTICE, settings.notice)

    GATE.arm(_word_on(ctl, run.token), go)
    try:
        outcome = run_attempt(run.profile, request, out, settings)
        GATE.wait()  # an attempt that failed before its request waits for its word too
    except AttemptDropped:
        log.debug("attempt dropped before its request: never authorized")
        return None
    finally:
        GATE.open()
    if outcome.error is not None:
        outcome = _failed(outcome, outcome.error, out)
    if outcome.dropped_tool_names:
        names = ", ".join(outcome.dropped_tool_names)
        log.warning("tool call(s) dropped, never executed: %s", names)
        out.delta(NOTICE, f"The stream ended before these tool calls were complete; they were "
                          f"dropped and not executed: {names}.")
    if outcome.finish_reason == "content_filter":
        out.delta(NOTICE, "The provider stopped this answer with its content "
                          "filter (finish_reason content_filter).")
    live.end_stream(slot)  # from here on only the sink is waited for
    _, _, chunks, nbytes = live.read(slot)
    outcome = replace(outcome, diag=AttemptDiag(
        first_chunk_ms=(out.first_chunk_ns - started) / 1e6 if out.first_chunk_ns else None,
        chunks=chunks, bytes=nbytes, deltas=out.seq,
        duration_ms=(time.monotonic_ns() - started) / 1e6))
    accepted = out.finish(outcome_to_wire(outcome), settings.final_ack_timeout_s)
    log.info("attempt ended: finish_reason=%s deltas=%d final_accepted=%s",
             outcome.finish_reason, out.seq, accepted,
             extra={"fields": {"finish_reason": outcome.finish_reason}}
             if outcome.finish_reason else None)
    return accepted


def worker_main(worker_id: int, slot: int, runtime_dir: str, slots: int,
                log_level: int, warm: bool = False) -> NoReturn:
    """Entry point of a forked worker; never returns. `warm`: a spare, which
    warms up after its hello while no attempt waits (workers.warmup.warm_spare)."""
    idle = f"worker {worker_id} (idle)"
    set_process_title(idle)
    ep = Endpoints(runtime_dir)
    ctx = zmq.Context()
    logs = ctx.socket(zmq.PUSH)
    logs.linger = 1000
    logs.sndhwm = 10_000
    logs.connect(ep.logs)
    route_logs_to(logs, log_level, f"worker-{worker_id}", forked=True)  # the zygote's level
    ctl = ctx.socket(zmq.DEALER)
    ctl.linger = 0
    ctl.setsockopt(zmq.IDENTITY, b"w%d" % worker_id)
    ctl.connect(ep.workers)
    sink = SinkChannel(ep.sink_stream)
    live = LivenessTable(ep.liveness_file, slots)
    ctl.send(worker_hello_frame(worker_id, os.getpid()))
    code = ExitCode.OK
    try:
        if warm:
            warm_spare(lambda: bool(ctl.poll(0)))
        while True:
            run = _receive(ctl, parse_run)
            set_process_title(f"worker {worker_id} (call {run.call_id[:8]}…, "
                              f"attempt {run.attempt})")
            accepted = _run_one(run, ctl, sink, live, slot)
            clear_context()
            set_process_title(idle)
            if accepted is not None:  # a dropped attempt's worker is idle already
                ctl.send(idle_frame(worker_id, run.token, accepted))
    except Exception:
        log.exception("worker crashed")
        code = ExitCode.CRASHED
    finally:
        logging.shutdown()
        sink.close()
        for s in (ctl, logs):
            s.close()
        ctx.term()
    os._exit(code)
