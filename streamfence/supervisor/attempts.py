"""Driving attempts: schedule a queued call on a warm worker, authorize its
attempt at the sink first, watch liveness, fence then kill a stale or dead
attempt, decide (streamfence.supervisor.calls.decide), back off, and finish.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from streamfence.config.model import DaemonConfig
from streamfence.protocol.codec import encode
from streamfence.protocol.errors import ErrorCode
from streamfence.protocol.internal.control import (
    AttemptStats,
    Ended,
    FinalRefused,
    FinishMeta,
    FollowedDone,
    Lost,
)
from streamfence.protocol.internal.outcome import AttemptError, AttemptOutcome
from streamfence.protocol.internal.workers import AttemptSettings, RunAttempt
from streamfence.protocol.messages import CallStatus
from streamfence.protocol.states import CallState, FenceReason
from streamfence.sink.transcript import answer_so_far, read_events_after
from streamfence.supervisor.breaker import Breakers
from streamfence.supervisor.calls import (
    BUSY_STATES,
    MOVED,
    Call,
    CallEvent,
    Finish,
    call_error,
    decide,
    fence_error,
)
from streamfence.supervisor.clients import Clients
from streamfence.supervisor.fallbacks import Fallbacks
from streamfence.supervisor.histograms import Histograms, attempt_outcome
from streamfence.supervisor.journal import Journal
from streamfence.supervisor.logs import log_with_traceback
from streamfence.supervisor.pool import Pool, exit_text
from streamfence.supervisor.recovery import make_call
from streamfence.supervisor.sinklink import (
    SINK_LOST,
    DoneReply,
    Refused,
    SinkLink,
    SinkLost,
    StatsReply,
    why,
)
from streamfence.supervisor.timeouts import backoff_delay
from streamfence.supervisor.timers import Deadlines

if TYPE_CHECKING:  # cluster mode only: it brings nats
    from streamfence.cluster.ledger import Owner
    from streamfence.supervisor.clusterlink import ClusterLink

log = logging.getLogger("streamfence.attempts")

# How long a worker waits for the sink to acknowledge its final. Long: the
# provider is done and a slow or frozen sink is not its fault (the stale
# watchdog leaves such an attempt alone); a sink that dies instead is
# restarted and the attempt rebound (ARCHITECTURE §2.8).
FINAL_ACK_TIMEOUT_S = 600.0


def _ctx(call: Call) -> dict[str, Any]:
    return {"session_id": call.spec.session_id, "call_id": call.call_id, "attempt": call.epoch}


def _breaker_key(call: Call) -> tuple[str, str]:
    return (call.spec.session_id or "-", call.profile.name)


class AttemptDriver:
    """Owns the live calls (`Call`: state machine, epochs, the decision being
    written), the run queue, the reservation tokens and the per-profile
    fall-backs; counts the live calls and their request bytes per owner (the
    byte budgets), retries and calls by status. Talks to the sink through
    the SinkLink, to workers through the Pool, records in the Journal, and
    tells Clients `on_call_done` when a call's done event is stored.
    """

    def __init__(self, config: DaemonConfig, journal: Journal, pool: Pool, sink: SinkLink,
                 clients: Clients, breakers: Breakers, counters: Counter[str],
                 clock: Callable[[], float], rng: random.Random, transcript_path: str,
                 cluster: ClusterLink | None = None) -> None:
        self._config = config
        self._cluster = cluster  # cluster mode: each attempt's ownership first (§4.17)
        self._transcript_path = transcript_path
        self._journal = journal
        self._pool = pool
        self._sink = sink
        self._clients = clients
        self._breakers = breakers
        self._clock = clock
        self._rng = rng
        self._fallbacks = Fallbacks(clock)
        self._calls: dict[str, Call] = {}
        self._in_flight: Counter[str] = Counter()  # owner -> live calls
        # The request bytes of the live calls (`Call.request_bytes`): per owner
        # and in all; taken in `enqueue`, given back in `_forget`, as in_flight.
        self._in_flight_bytes: Counter[str] = Counter()
        self._bytes_total = 0
        self._queue: deque[str] = deque()
        # Each live call's next check (stale, first chunk, backoff over, deadline).
        self._due: Deadlines[str] = Deadlines()
        self._next_token = 1
        self._counters = counters
        # Durations for `status` (protocol/histograms.py): observed once per
        # attempt end and per call end, never per delta.
        self.histograms = Histograms()

    # ---- what the front and recovery ask -------------------------------------------
    def enqueue(self, call: Call, staged: bool = False) -> None:
        """A new (or recovered) call, to run when a worker is free; a `staged`
        one (its request file not durable yet) counts against the budgets at
        once but waits for `release`."""
        self._calls[call.call_id] = call
        self._in_flight[call.owner] += 1
        if not call.request_bytes:
            # A recovered call has no submit frame: its journaled request's encoding.
            call.request_bytes = len(encode(call.spec.request))
        self._in_flight_bytes[call.owner] += call.request_bytes
        self._bytes_total += call.request_bytes
        if not staged:
            self.release(call.call_id)

    def release(self, call_id: str) -> None:
        """A call is accepted: it joins the queue (its deadline runs from now on)."""
        call = self._calls[call_id]
        self._queue.append(call_id)
        self._arm_deadline(call)
        self.histograms.accepted(call_id, self._clock())

    def drop(self, call_id: str) -> None:
        """A call that was never accepted: its request file could not be
        written, or its journal writes failed (a storage fault). A first
        attempt started in the same turn never reached the sink (its epoch
        waited for the same commit): its reserved worker goes back."""
        call = self._calls[call_id]
        worker = self._pool.get(call.worker_id) if call.worker_id is not None else None
        if worker is not None and worker.token == call.token:
            self._pool.release(worker)
        self._due.clear(call_id)
        self._forget(call)

    def _arm_deadline(self, call: Call) -> None:
        """A queued call's only timer is its deadline."""
        if call.deadline is not None:
            self._due.arm(call.call_id, call.deadline)
        else:
            self._due.clear(call.call_id)

    def has_call(self, call_id: str) -> bool:
        return call_id in self._calls

    def in_flight(self, owner: str) -> int:
        """Calls of `owner` accepted and not yet done."""
        return self._in_flight[owner]

    def in_flight_bytes(self, owner: str | None = None) -> int:
        """The request bytes of the calls accepted and not yet done: `owner`'s,
        or every call's."""
        return self._bytes_total if owner is None else self._in_flight_bytes[owner]

    def queued(self) -> int:
        return len(self._queue)

    def busy(self) -> int:
        """Calls with an attempt in flight (queued and backing-off ones wait in the journal)."""
        return sum(1 for c in self._calls.values() if c.state in BUSY_STATES)

    def cancel(self, call_id: str) -> None:
        """Cancel a live call, whatever its state (docs/ARCHITECTURE.md, "Cancel")."""
        call = self._calls[call_id]
        if call.cancel_requested:
            return
        call.cancel_requested = True
        if call.state in (CallState.QUEUED, CallState.BACKOFF):
            self.finish(call, Finish(CallStatus.CANCELLED, call_error(
                ErrorCode.CANCELLED, "cancelled by the client"), FinishMeta()))
        elif call.state is CallState.RUNNING:
            self.fence(call, FenceReason.CANCELLED)
        # AUTHORIZING / FENCING: the pending reply sees cancel_requested.

    def status(self, owner: str | None = None) -> dict[str, Any]:
        """Live calls by state, the bytes their requests hold (all of them also
        per owner, and the budget), and the first 100 of them; only `owner`'s if given."""
        calls = [c for c in self._calls.values() if owner is None or c.owner == owner]
        by_state: dict[str, int] = {}
        for call in calls:
            by_state[call.state.value] = by_state.get(call.state.value, 0) + 1
        queued = sum(1 for c in calls if c.state is CallState.QUEUED)
        held: dict[str, Any] = {"in_flight_bytes": self.in_flight_bytes(owner)}
        if owner is None:
            held.update(in_flight_bytes_max=self._config.in_flight_bytes_max,
                        in_flight_bytes_by_owner=dict(self._in_flight_bytes))
        return {"active": len(calls), "queued": queued, "by_state": by_state, **held,
                "running": [{"call_id": c.call_id, "owner": c.owner, "state": c.state.value,
                             "attempt": c.epoch, "session_id": c.spec.session_id,
                             "provider": c.profile.name} for c in calls[:100]]}

    # ---- scheduling ----------------------------------------------------------
    def schedule(self) -> None:
        """Start queued calls while warm workers are free."""
        started: list[Call] = []
        queue = self._queue
        while queue:
            call = self._calls.get(queue[0])
            if call is None or call.state is not CallState.QUEUED:
                queue.popleft()
                continue
            if call.deadline is not None and self._clock() >= call.deadline:
                queue.popleft()
                self.finish(call, Finish(CallStatus.FAILED, call_error(
                    ErrorCode.DEADLINE_EXCEEDED,
                    "the call's deadline passed before an attempt could start"), FinishMeta()))
                continue
            token = self._next_token
            worker = self._pool.reserve(call.call_id, call.epoch + 1, token)
            if worker is None:
                break
            self._next_token += 1
            queue.popleft()
            call.epoch += 1
            call.attempts += 1
            call.token = token
            call.worker_id = worker.worker_id
            call.fence_reason = None
            call.ended = None
            call.to(CallEvent.START)
            self._journal.start_attempt(call.call_id, call.epoch)
            started.append(call)
        # The forks the queue needs are asked for first (all at once): the zygote
        # forks while the journal commits and the sink authorizes.
        self._pool.maintain(demand=sum(1 for cid in queue if cid in self._calls))
        if started:
            # Epochs are durable before the sink hears of them (AUTHORIZING
            # calls change state only on the sink's answer, so they wait as they are).
            self._journal.commit(then=functools.partial(self._authorize, started))

    def _authorize(self, started: list[Call]) -> None:
        for call in started:
            if call.call_id not in self._calls:
                continue  # dropped: its journal writes never committed (front.refuse_unstored)
            if self._cluster is not None:
                self._cluster.take(call.call_id, call.epoch,
                                   functools.partial(self._owned, call, call.epoch))
            else:
                self._authorize_at_sink(call)

    def _authorize_at_sink(self, call: Call, log_seq: int = 0) -> None:
        reset = call.delivered  # only under on_partial=restart can this hold here
        model = str(call.spec.request.get("model") or call.spec.request.get("modelId") or "-")
        self._sink.authorize(call.call_id, call.epoch, reset, model,
                             functools.partial(self._authorized, call), log_seq)

    def _owned(self, call: Call, epoch: int, result: int | bool | str) -> None:
        """Cluster mode: the attempt's ownership was taken and its epoch opened
        in the call's log at `result` (a sequence), is another host's (False),
        or the cluster failed (why): tried again later."""
        if self._calls.get(call.call_id) is not call or call.epoch != epoch:
            return
        if isinstance(result, int) and not isinstance(result, bool):
            self._authorize_at_sink(call, result)
            return
        worker = self._pool.get(call.worker_id)
        if worker is not None:
            self._pool.release(worker)
        if result is False:
            self._move(call)
            return
        call.to(CallEvent.REFUSED)
        self._queue.appendleft(call.call_id)  # the next turn asks again

    def adopt(self, owner: Owner, record: dict[str, Any]) -> None:
        """Cluster mode: this host took the call over at `owner.epoch` from a host
        that lost its lease, or took up a stray of its own (§4.17, rule 4). It
        is journaled here, the sink stores what its log holds (C_ADOPT), and it
        runs as a recovered call does: under that epoch, with a reset first if
        anything was delivered. A call this host's journal has ended (its
        entry outlived its done) is only released."""
        call_id = owner.call_id
        assert self._cluster is not None
        profile = self._config.providers.get(record.get("provider", ""))
        if profile is None or call_id in self._calls:
            log.error("cluster: call %s taken over names provider %r, which this host does "
                      "not have (or it is known here); left as is", call_id,
                      record.get("provider"))
            return
        if self._journal.is_finished(call_id) and not self._journal.is_moved(call_id):
            log.info("cluster: call %s taken up had ended here; its entry goes", call_id)
            self._cluster.finished(call_id)
            return
        call = make_call(call_id, record["owner"], profile, record["request"],
                         record.get("options") or {}, record.get("session_id"),
                         record.get("idempotency_key"), None, owner.epoch - 1,
                         owner.epoch - 1)
        self._journal.take_back(call_id)  # a call it had moved away: journaled anew
        self._journal.add_call(call_id, call.owner, call.spec.idempotency_key,
                               call.spec.session_id, profile.name, call.spec.request,
                               call.spec.options.to_map())
        self.enqueue(call, staged=True)  # it runs once the sink holds its log
        self._counters["calls_taken_over"] += 1
        log.warning("cluster: call taken over at epoch %d", owner.epoch, extra=_ctx(call))
        self._sink.adopt(call_id, owner.epoch, functools.partial(self._adopted, call))

    def _adopted(self, call: Call, reply: StatsReply) -> None:
        if self._calls.get(call.call_id) is not call:
            return
        if isinstance(reply, AttemptStats):
            call.delivered = reply.last_seq > 0  # a reset first: §4.10's rule
            self.release(call.call_id)
            return
        if isinstance(reply, Refused) and reply.reason.startswith("call_finished"):
            status = reply.reason.partition(": ")[2] or "completed"
            log.info("cluster: the call taken over had ended (%s)", status, extra=_ctx(call))
            self._journal.finish_call(call.call_id, status)
            if self._cluster is not None:
                self._cluster.finished(call.call_id)
            self._forget(call)
            return
        log.error("cluster: the sink could not take the call's log: %s", why(reply),
                  extra=_ctx(call))
        self._move(call)

    def _move(self, call: Call) -> None:
        """Cluster mode: another host owns the call now; this host forgets it
        (its journal says `moved`), without a done."""
        log.warning("call moved to another host of the cluster; forgetting it here",
                    extra=_ctx(call))
        self._due.clear(call.call_id)
        self._journal.finish_call(call.call_id, MOVED)
        self._counters["calls_moved"] += 1
        self._forget(call)

    def _authorized(self, call: Call, reply: StatsReply) -> None:
        worker = self._pool.get(call.worker_id)
        if not isinstance(reply, AttemptStats):
            if worker is not None:
                self._pool.release(worker)
            call.to(CallEvent.REFUSED)
            if reply is SINK_LOST:
                self._queue.appendleft(call.call_id)  # the restarted sink will answer
                return
            if isinstance(reply, Refused) and reply.reason.startswith("cluster_lost"):
                self._move(call)  # the sink found the call's log taken by another host
                return
            # The sink knows better (e.g. an epoch it has seen, set after a
            # crash): never spin on it; fail the call with what it said.
            log.warning("sink refused to authorize attempt: %s", why(reply), extra=_ctx(call))
            self.finish(call, Finish(CallStatus.FAILED, call_error(
                ErrorCode.INTERNAL, f"the sink refused the attempt: {why(reply)}"), FinishMeta()))
            return
        if call.delivered:
            call.delivered = False  # the reset voided it
        call.content_from = call.epoch
        call.to(CallEvent.AUTHORIZED)
        if call.cancel_requested or worker is None or worker.token != call.token:
            # Cancelled while authorizing, or the reserved worker died: fence
            # the (never started) attempt, then decide.
            if worker is not None:
                self._pool.release(worker)
            self.fence(call, FenceReason.CANCELLED if call.cancel_requested
                       else FenceReason.WORKER_DIED)
            return
        call.dispatched_ns = time.monotonic_ns()
        self._arm_watch(call, call.dispatched_ns, call.timeouts.first_chunk_s)
        self._journal.set_attempt_pid(call.call_id, call.epoch, worker.pid)
        profile = call.profile.name
        settings = AttemptSettings(
            streaming=self._fallbacks.streaming(profile) and not call.probe_next,
            include_usage=self._fallbacks.include_usage(profile),
            connect_timeout_s=call.timeouts.connect_s, read_timeout_s=call.timeouts.read_s,
            final_ack_timeout_s=FINAL_ACK_TIMEOUT_S, notice=call.notice)
        call.probe_next = False
        call.notice = None
        # A large request goes as its file's name: the worker reads it there.
        request = call.spec.request if call.request_file is None else call.request_overrides
        run = RunAttempt(call.token, call.call_id, call.epoch, call.spec.session_id,
                         call.profile.to_map(), request, settings, call.request_file)
        if not self._pool.dispatch(worker, run):
            self.fence(call, FenceReason.WORKER_DIED)
            return
        log.debug("attempt dispatched to worker %d (pid %d)", worker.worker_id, worker.pid,
                  extra=_ctx(call))

    # ---- timers -------------------------------------------------------------
    def next_due(self) -> float | None:
        """When `on_timers` next has something to do (monotonic seconds)."""
        return self._due.next_due()

    def on_timers(self, now: float) -> None:
        """Act on every call whose timer came: a running attempt's stale or
        first-chunk check, a backoff that is over, a deadline."""
        for call_id in self._due.pop_due(now):
            call = self._calls.get(call_id)
            if call is None:
                continue
            if call.state is CallState.RUNNING:
                self._check_stale(call, now)
            elif call.state is CallState.BACKOFF:
                call.to(CallEvent.BACKOFF_OVER)
                self._queue.appendleft(call.call_id)
                self._arm_deadline(call)
            elif call.state is CallState.QUEUED:
                if call.deadline is not None and now >= call.deadline:
                    self.finish(call, Finish(CallStatus.FAILED, call_error(
                        ErrorCode.DEADLINE_EXCEEDED,
                        "the call's deadline passed before an attempt could start"),
                        FinishMeta()))
                else:
                    self._arm_deadline(call)
            # AUTHORIZING, FENCING, FINISHING: the pending sink reply moves the
            # call on, and arms its next timer.

    def _arm_watch(self, call: Call, since_ns: int, limit_s: float) -> None:
        """A running attempt is next looked at when `limit_s` passes from
        `since_ns` without a chunk, or at its deadline if that is sooner."""
        left_s = limit_s - (time.monotonic_ns() - since_ns) / 1e9  # liveness is in monotonic ns
        when = self._clock() + max(0.0, left_s)
        if call.deadline is not None:
            when = min(when, call.deadline)
        self._due.arm(call.call_id, when)

    def _check_stale(self, call: Call, now: float) -> None:
        """The stale watchdog (docs/ARCHITECTURE.md §4.1), for one running
        attempt whose timer came: the liveness row says when its last chunk was."""
        worker = self._pool.get(call.worker_id)
        if worker is None:
            return  # its exit report fences it
        token, last_ns, chunks, _ = self._pool.liveness(worker)
        if token == call.token and worker.token == call.token and self._pool.stream_over(worker):
            # The provider has sent everything: the worker waits for the sink,
            # whose time is never the provider's stall (nor the breaker's).
            now_ns = time.monotonic_ns()
            log.info("the provider's stream is over; waiting for the sink (%.1fs since its "
                     "last chunk)", (now_ns - last_ns) / 1e9, extra=_ctx(call))
            self._arm_watch(call, now_ns, call.timeouts.stale_s)
            return
        if token == call.token and chunks > 0:
            since, limit = last_ns, call.timeouts.stale_s
        else:
            since, limit = call.dispatched_ns, call.timeouts.first_chunk_s
        now_ns = time.monotonic_ns()
        if now_ns - since >= limit * 1e9:
            log.warning("stale attempt: no chunk for %.1fs (limit %.1fs, chunks so far %d)",
                        (now_ns - since) / 1e9, limit, chunks if token == call.token else 0,
                        extra=_ctx(call))
            self.fence(call, FenceReason.STALE)
        elif call.deadline is not None and now >= call.deadline:
            self.fence(call, FenceReason.DEADLINE)
        else:
            self._arm_watch(call, since, limit)

    # ---- ending an attempt ----------------------------------------------------
    def fence(self, call: Call, reason: FenceReason) -> None:
        """Close the attempt at the sink; once acknowledged, kill its worker."""
        call.fence_reason = reason
        call.to(CallEvent.FENCE)
        self._sink.fence(call.call_id, call.epoch,
                         functools.partial(self._fenced, call, call.epoch))

    def _fenced(self, call: Call, epoch: int, reply: StatsReply) -> None:
        if call.state is not CallState.FENCING or call.epoch != epoch:
            return
        if call.ended is not None:
            # The sink accepted the attempt's final before the fence: it finished.
            ended_stats, outcome = call.ended
            self._decide(call, ended_stats, outcome, outcome.error)
            return
        # Without the sink's answer: what subscribers could see of the attempt.
        stats = reply if isinstance(reply, AttemptStats) else self._stats_from_transcript(call)
        reason = call.fence_reason
        assert reason is not None, "fenced without a reason"
        if reason is FenceReason.STALE:
            self._breakers.on_stale(_breaker_key(call))  # once per attempt: fenced once
        worker = self._pool.get(call.worker_id)
        if worker is not None and worker.token == call.token:
            self._pool.kill(worker)  # fenced first, so the kill cannot lose an accepted delta
            self._pool.maintain()
        self._journal.end_attempt(call.call_id, call.epoch, reason.value, None)
        if reason is FenceReason.CLUSTER_LOST:
            self._move(call)
            return
        self._decide(call, stats, None, fence_error(reason, call.timeouts.stale_s))

    def on_ended(self, ended: Ended) -> None:
        """The sink accepted an attempt's final message."""
        call = self._calls.get(ended.call_id)
        if call is None or call.epoch != ended.attempt:
            return
        self._fallbacks.learn(call.profile.name, ended.outcome)
        if call.state is CallState.FENCING:
            call.ended = (ended.stats, ended.outcome)  # decided when the fence reply arrives
            return
        if call.state is not CallState.RUNNING:
            return
        self._journal.end_attempt(call.call_id, call.epoch, "ended", ended.outcome)
        self._decide(call, ended.stats, ended.outcome, ended.outcome.error)

    def on_lost(self, lost: Lost) -> None:
        """Cluster mode: the cluster refused the attempt's run (another host
        opened a later epoch): the attempt is fenced at the sink already; its
        worker is killed and the call forgotten here."""
        call = self._calls.get(lost.call_id)
        if call is None or call.epoch != lost.attempt:
            return
        self._counters["cluster_lost"] += 1
        if call.state is CallState.RUNNING:
            self.fence(call, FenceReason.CLUSTER_LOST)
        elif call.state is CallState.FENCING:
            call.fence_reason = FenceReason.CLUSTER_LOST

    def on_followed_done(self, followed: FollowedDone) -> None:
        """Cluster mode: a call another host ran ended; this host's `result`
        waiters get its done (its attempts' diagnostics are that host's)."""
        self._clients.on_call_done(followed.call_id, followed.done, list)

    def on_final_refused(self, refused: FinalRefused) -> None:
        call = self._calls.get(refused.call_id)
        if call is not None and call.epoch == refused.attempt and call.state is CallState.RUNNING:
            log.warning("final message refused by the sink: %s", refused.reason, extra=_ctx(call))
            self.fence(call, FenceReason.FINAL_REFUSED)

    def on_final_unaccepted(self, call_id: str, token: int) -> None:
        """The run's worker went idle without the sink accepting its final (the
        sink refused it, or told the worker its attempt was over): nothing
        more will come of it."""
        call = self._calls.get(call_id)
        if call is not None and call.token == token and call.state is CallState.RUNNING:
            log.warning("the worker ended the attempt without an accepted final",
                        extra=_ctx(call))
            self.fence(call, FenceReason.FINAL_REFUSED)

    def on_worker_exit(self, call_id: str | None, token: int, returncode: int) -> None:
        call = self._calls.get(call_id or "")
        if call is None or call.token != token:
            return
        if call.state is CallState.RUNNING:
            log.warning("worker died mid-attempt (exit %s)", exit_text(returncode),
                        extra=_ctx(call))
            self.fence(call, FenceReason.WORKER_DIED)

    def _decide(self, call: Call, stats: AttemptStats, outcome: AttemptOutcome | None,
                error: AttemptError | None) -> None:
        self._counters["attempts." + attempt_outcome(outcome, call.fence_reason)] += 1
        self.histograms.attempt_ended(outcome)
        if stats.visible_chars > 0:
            call.delivered = True
        # An unexpected exception's traceback, for the call's last line if this
        # attempt is its last (logged once, in `_log_end`).
        call.traceback = error.traceback if error is not None else None
        if error is not None:
            adjusted = self._fallbacks.adjust(call.profile.name, error, stats.accepted, _ctx(call))
            error = adjusted.error
            if adjusted.probe_next:
                call.probe_next = True
        decision = decide(call, stats, outcome, error, self._clock())
        if error is None and outcome is not None:
            self._breakers.on_success(_breaker_key(call))
        elif call.fence_reason is not FenceReason.STALE:
            self._breakers.on_probe_ended(_breaker_key(call))
        if isinstance(decision, Finish):
            self.finish(call, decision)
            return
        cfg = self._config
        delay = backoff_delay(call.attempts, cfg.backoff_base_s, cfg.backoff_max_s,
                              decision.retry_after_s, self._rng)
        now = self._clock()
        if call.deadline is not None and now + delay >= call.deadline:
            self.finish(call, Finish(CallStatus.FAILED, call_error(
                ErrorCode.DEADLINE_EXCEEDED,
                "the deadline leaves no time for the next attempt's backoff"), FinishMeta()))
            return
        message = error.message if error is not None else None
        if stats.tool_fragments > 0:
            call.notice = (f"The connection dropped in the middle of a tool call "
                           f"({message}); the request is retried "
                           f"and the tool call starts over.")
        log.info("retrying after %.2fs: %s", delay, message, extra=_ctx(call))
        call.retry_at = now + delay
        call.to(CallEvent.RETRY)
        self._due.arm(call.call_id, call.retry_at)
        self._counters["retries"] += 1

    # ---- finishing -----------------------------------------------------------
    def finish(self, call: Call, decision: Finish) -> None:
        self._due.clear(call.call_id)
        call.to(CallEvent.FINISH)
        call.finishing = decision
        self._send_finish(call, decision)

    def _send_finish(self, call: Call, decision: Finish) -> None:
        self._sink.finish(call.call_id, decision.status, decision.error, call.attempts,
                          decision.meta, functools.partial(self._finished, call))

    def _finished(self, call: Call, reply: DoneReply) -> None:
        if isinstance(reply, SinkLost) and call.finishing is not None:
            # Ask the restarted sink again (a repeated finish is idempotent there).
            self._send_finish(call, call.finishing)
            return
        if isinstance(reply, Refused) and reply.reason.startswith("cluster_lost"):
            self._move(call)  # the cluster refused its done: another host owns the call
            return
        if not isinstance(reply, dict):
            log.error("sink refused to finish the call: %s", why(reply), extra=_ctx(call))
            return
        done = reply
        call.to(CallEvent.FINISHED)
        status = str(done.get("status"))
        self._journal.finish_call(call.call_id, status)
        self._counters["calls_" + status] += 1
        self.histograms.call_done(call.call_id, self._clock())
        self._log_end(call, status)
        self._clients.on_call_done(call.call_id, done,
                                   functools.partial(self._journal.attempts_of, call.call_id))
        if self._cluster is not None:
            self._cluster.finished(call.call_id)
        self._forget(call)

    @staticmethod
    def _log_end(call: Call, status: str) -> None:
        """The call's last line. A failed call's is its only ERROR, with the
        traceback of its last attempt's unexpected exception if one ended it:
        each attempt's failure was one WARNING line without one (its worker's,
        or the fence's), and a call that failed attempts but then completed
        logs no ERROR (ARCHITECTURE §4.9)."""
        error = call.finishing.error if call.finishing is not None else None
        said = f": {error['code']}: {error['message']}" if error else ""
        if status == CallStatus.FAILED:
            log_with_traceback(log, logging.ERROR, call.traceback,
                               "call failed after %d attempt(s)%s", call.attempts, said,
                               context=_ctx(call))
        elif call.traceback is not None:  # partial: text, then an unexpected exception
            log_with_traceback(log, logging.WARNING, call.traceback, "call %s after %d "
                               "attempt(s)%s", status, call.attempts, said, context=_ctx(call))
        else:
            log.info("call %s after %d attempt(s)%s", status, call.attempts, said,
                     extra=_ctx(call))

    def _forget(self, call: Call) -> None:
        """A done call is no longer live: its count and its request bytes go
        back to its owner's and the daemon's budgets (the only way out of
        `_calls`)."""
        del self._calls[call.call_id]
        self.histograms.forget(call.call_id)
        if self._cluster is not None:
            self._cluster.forget(call.call_id)
        owner = call.owner
        self._in_flight[owner] -= 1
        self._in_flight_bytes[owner] -= call.request_bytes
        self._bytes_total -= call.request_bytes
        if not self._in_flight[owner]:
            del self._in_flight[owner]
            del self._in_flight_bytes[owner]

    # ---- the sink died ---------------------------------------------------------
    def on_sink_restart(self) -> None:
        """Fail the requests the dead sink never answered, then rebind every
        attempt still running (docs/ARCHITECTURE.md §2.8): its worker keeps its
        provider stream and goes on under a new epoch at the new sink, from
        what the transcript holds. The new epochs are durable first, as for
        any attempt; the call stays RUNNING meanwhile (a fence sent after the
        rebind closes the new epoch)."""
        self._sink.fail_pending()
        rebound = []
        for call in list(self._calls.values()):
            if call.state is not CallState.RUNNING:
                continue
            old = call.epoch
            call.epoch += 1
            self._journal.rebind_attempt(call.call_id, old, call.epoch)
            worker = self._pool.get(call.worker_id)
            if worker is not None and worker.token == call.token:
                self._journal.set_attempt_pid(call.call_id, call.epoch, worker.pid)
            rebound.append((call, old))
        if rebound:
            self._journal.commit(then=functools.partial(self._rebind, rebound))

    def _rebind(self, rebound: list[tuple[Call, int]]) -> None:
        for call, old in rebound:
            if call.state is not CallState.RUNNING:
                continue
            if self._cluster is not None:  # the new epoch is owned first, as any (§4.17)
                self._cluster.take(call.call_id, call.epoch, functools.partial(
                    self._rebind_owned, call, call.epoch, old), open_log=False)
            else:
                self._rebind_at_sink(call, old)

    def _rebind_at_sink(self, call: Call, old: int) -> None:
        self._sink.rebind(call.call_id, call.epoch, old, call.content_from, call.token,
                          functools.partial(self._rebound, call, call.epoch))

    def _rebind_owned(self, call: Call, epoch: int, old: int, result: int | bool | str) -> None:
        if call.epoch != epoch or call.state is not CallState.RUNNING:
            return
        if isinstance(result, int) and not isinstance(result, bool):
            self._rebind_at_sink(call, old)
        else:
            self.fence(call, FenceReason.CLUSTER_LOST if result is False
                       else FenceReason.SINK_RESTARTED)

    def _rebound(self, call: Call, epoch: int, reply: StatsReply) -> None:
        if call.epoch != epoch or call.state is not CallState.RUNNING:
            return  # fenced or ended meanwhile: that path decides
        if reply is SINK_LOST:
            return  # the sink died again: on_sink_restart rebinds it again
        if not isinstance(reply, AttemptStats):
            log.warning("the restarted sink refused to rebind the attempt: %s", why(reply),
                        extra=_ctx(call))
            self.fence(call, FenceReason.SINK_RESTARTED)
            return
        self._counters["attempts_rebound"] += 1
        log.info("the sink restarted: the attempt goes on as attempt %d after seq %d",
                 epoch, reply.last_seq, extra=_ctx(call))

    def _stats_from_transcript(self, call: Call) -> AttemptStats:
        """The current attempt's stats as the transcript holds them (events are
        sent only after their commit: what subscribers could see)."""
        stored = read_events_after(self._transcript_path, call.call_id) \
            if os.path.exists(self._transcript_path) else []  # no sink ever started
        # A rebound attempt's answer began at call.content_from.
        answer = answer_so_far(stored, call.content_from, call.epoch)
        return AttemptStats(call.epoch, accepted=answer.deltas(),
                            visible_chars=answer.visible_chars(),
                            tool_fragments=answer.tool_fragments())
