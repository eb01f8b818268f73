"""Driving attempts: the one place that moves a call through its state
machine (streamfence.supervisor.calls: CallState, CallEvent). Schedule a
queued call on a warm worker (which prepares it), authorize its attempt at
the sink (cluster mode: own it first, ARCHITECTURE §4.17), then let the worker
send it; fence then kill a stale or dead attempt, decide, back off, finish.

Its helpers, each with one job and no say over a call's state:
- livecalls.LiveCalls: the live calls and what they hold of the budgets;
- watchdog.Watchdog: each live call's next check, and the stale watchdog;
- callends.CallEnds: the ways out (done, moved, never accepted);
- rebind.Rebinds: the running attempts rebound after a sink restart;
- takeover.Takeover: cluster mode, a call taken over from another host;
- verdicts.Verdicts: what an ended attempt means, what breakers and fall-backs learn;
- deployments.Router: a group's call's deployment for each attempt.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from streamfence.config.model import DaemonConfig
from streamfence.protocol.errors import ErrorCode
from streamfence.protocol.failpoints import ARMED, failpoint
from streamfence.protocol.internal.control import (
    AttemptStats,
    Ended,
    FinalRefused,
    FinishMeta,
    FollowedDone,
    Lost,
)
from streamfence.protocol.internal.outcome import AttemptError, AttemptOutcome
from streamfence.protocol.messages import CallStatus
from streamfence.protocol.states import CallState, FenceReason
from streamfence.sink.transcript import visible_stats
from streamfence.supervisor.breaker import Breakers
from streamfence.supervisor.callends import CallEnds
from streamfence.supervisor.calls import (
    Call,
    CallEvent,
    Finish,
    call_error,
    deadline_passed,
    fence_error,
)
from streamfence.supervisor.clients import Clients
from streamfence.supervisor.deployments import Router
from streamfence.supervisor.dispatch import run_attempt
from streamfence.supervisor.epoch_join import EpochJoin
from streamfence.supervisor.fallbacks import Fallbacks
from streamfence.supervisor.histograms import Histograms, attempt_outcome
from streamfence.supervisor.journal import Journal
from streamfence.supervisor.livecalls import LiveCalls, call_context
from streamfence.supervisor.pool import Pool
from streamfence.supervisor.rebind import Rebinds
from streamfence.supervisor.sinklink import (
    SINK_LOST,
    Finished,
    FinishReply,
    Refused,
    SinkLink,
    SinkLost,
    StatsReply,
    why,
)
from streamfence.supervisor.takeover import Takeover
from streamfence.supervisor.tracing import CallTracer
from streamfence.supervisor.verdicts import Verdicts
from streamfence.supervisor.watchdog import Watchdog
from streamfence.supervisor.worker_states import exit_text

if TYPE_CHECKING:  # cluster mode only: it brings nats
    from streamfence.supervisor.clusterlink import ClusterLink

log = logging.getLogger("streamfence.attempts")


class AttemptDriver:
    """Owns each live call's state (`Call`: state machine, epochs, the
    decision being written), the run queue, the reservation tokens and the
    per-profile fall-backs; `calls` (LiveCalls) holds the live calls, and
    `takeover` (cluster mode) takes calls over. Counts retries and attempts
    by outcome. Talks to the sink through the SinkLink, to workers through
    the Pool, records in the Journal.
    """

    def __init__(self, config: DaemonConfig, journal: Journal, pool: Pool, sink: SinkLink,
                 clients: Clients, breakers: Breakers, counters: Counter[str],
                 clock: Callable[[], float], rng: random.Random, transcript_path: str,
                 cluster: ClusterLink | None = None, tracer: CallTracer | None = None) -> None:
        self._cluster = cluster  # cluster mode: each attempt's ownership first (§4.17)
        self._transcript_path, self._journal = transcript_path, journal
        self._pool, self._sink, self._clients, self._clock = pool, sink, clients, clock
        self._fallbacks = Fallbacks(clock)
        self._verdicts = Verdicts(config, self._fallbacks, breakers, clock, rng)
        self.calls = LiveCalls(config.in_flight_bytes_max)
        self.router = Router(breakers, self.calls)
        self._queue: deque[str] = deque()
        self._due = Watchdog(pool, clock)  # each live call's next check
        self._next_token = 1
        self._counters = counters
        self.histograms = Histograms()  # observed per attempt end and call end, never per delta
        self._ends = CallEnds(self.calls, self._due, journal, clients, counters,
                              self.histograms, clock, cluster, tracer)
        self._rebinds = Rebinds(self.calls, journal, pool, sink, counters, self.fence, cluster)
        self.takeover = None if cluster is None else Takeover(
            config, self.calls, journal, sink, self._ends, counters, cluster, self.enqueue,
            self.release)

    # ---- what the front and recovery ask -------------------------------------------
    def enqueue(self, call: Call, staged: bool = False) -> None:
        """A new (or recovered) call, to run when a worker is free; a `staged`
        one (its request file not durable yet) counts against the budgets at
        once but waits for `release`."""
        self.calls.add(call)
        if not staged:
            self.release(call.call_id)

    def release(self, call_id: str) -> None:
        """A call is accepted: it joins the queue (its deadline runs from now on)."""
        call = self.calls[call_id]
        self._queue.append(call_id)
        self._due.arm_deadline(call)
        self.histograms.accepted(call_id, self._clock())

    def drop(self, call_id: str) -> None:
        """A call never accepted: its request file or its journal writes failed
        (a storage fault). A first attempt started in the same turn never reached
        the sink (its epoch waited for the same commit): its worker goes back."""
        call = self.calls[call_id]
        worker = self._pool.get(call.worker_id) if call.worker_id is not None else None
        if worker is not None and worker.token == call.token:
            self._pool.release(worker)
        self._due.clear(call_id)
        self._ends.forget(call)

    def queued(self) -> int:
        return len(self._queue)

    def cancel(self, call_id: str) -> None:
        """Cancel a live call, whatever its state (docs/ARCHITECTURE.md, "Cancel")."""
        call = self.calls[call_id]
        if call.cancel_requested:
            return
        call.cancel_requested = True
        if call.state in (CallState.QUEUED, CallState.BACKOFF):
            self.finish(call, Finish(CallStatus.CANCELLED, call_error(
                ErrorCode.CANCELLED, "cancelled by the client"), FinishMeta()))
        elif call.state is CallState.RUNNING:
            self.fence(call, FenceReason.CANCELLED)
        # AUTHORIZING / FENCING: the pending reply sees cancel_requested.

    # ---- scheduling ----------------------------------------------------------
    def schedule(self) -> None:
        """Start queued calls while warm workers are free."""
        started: list[Call] = []
        queue = self._queue
        while queue:
            call = self.calls.get(queue[0])
            if call is None or call.state is not CallState.QUEUED:
                queue.popleft()
                continue
            if call.deadline is not None and self._clock() >= call.deadline:
                queue.popleft()
                self.finish(call, deadline_passed())
                continue
            token = self._next_token
            worker = self._pool.reserve(call.call_id, call.epoch + 1, token)
            if worker is None:
                break
            self._next_token += 1
            queue.popleft()
            call.next_attempt(token, worker.worker_id)
            call.to(CallEvent.START)
            self.router.choose(call)
            self._journal.start_attempt(call.call_id, call.epoch, call.profile.name, call.model)
            # Prepared while the journal commits and the sink authorizes; sent at `go`.
            self._pool.prepare(worker, run_attempt(call, self._fallbacks))
            started.append(call)
        # The forks the queue needs are asked for first (all at once): the zygote
        # forks while the journal commits and the sink authorizes.
        self._pool.maintain(demand=sum(1 for cid in queue if self.calls.has(cid)))
        if not started:
            return
        # A retry is authorized while the journal syncs its epoch (epoch_join); a first
        # attempt's epoch is durable with its call before the sink hears of either.
        joins, firsts = [], []  # the retries' joins, the first attempts
        for call in started:
            if call.epoch > 1 and self._cluster is None:
                joins.append(EpochJoin(functools.partial(self._authorized, call)))
                self._authorize_at_sink(call, joins[-1].answered)
            else:
                firsts.append(call)
        self._journal.commit(then=functools.partial(self._authorize, firsts, joins))

    def _authorize(self, started: list[Call], joins: list[EpochJoin]) -> None:
        for join in joins:  # the retries: their authorize was sent at the schedule
            join.synced()
        for call in started:
            if not self.calls.has(call.call_id):
                continue  # dropped: its journal writes never committed (acceptance.refuse_unstored)
            if self._cluster is not None:
                self._cluster.take(call.call_id, call.epoch,
                                   functools.partial(self._owned, call, call.epoch))
            else:
                self._authorize_at_sink(call)

    def _authorize_at_sink(self, call: Call,
                           answered: Callable[[StatsReply], None] | None = None) -> None:
        reset = call.delivered  # only under on_partial=restart can this hold here
        if ARMED:
            failpoint("supervisor.before_authorize")
        self._sink.authorize(call.call_id, call.epoch, reset, call.model or "-",
                             answered or functools.partial(self._authorized, call))

    def _owned(self, call: Call, epoch: int, result: bool | str) -> None:
        """Cluster mode: the attempt's ownership taken (True: the sink opens its epoch
        in the call's log), another host's (False), or not known (why: asked again)."""
        if self.calls.get(call.call_id) is not call or call.epoch != epoch:
            return
        if result is True:
            self._authorize_at_sink(call)
            return
        worker = self._pool.get(call.worker_id)
        if worker is not None:
            self._pool.release(worker)
        if result is False:
            self._ends.moved(call)
            return
        call.to(CallEvent.REFUSED)
        self._queue.appendleft(call.call_id)  # the next turn asks again

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
                self._ends.moved(call)  # the sink found the call's log taken by another host
                return
            # The sink knows better: never spin on it; fail the call with what it said.
            log.warning("sink refused to authorize attempt: %s", why(reply),
                        extra=call_context(call))
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
        self._due.arm_watch(call, call.dispatched_ns, call.timeouts.first_chunk_s)
        self._journal.set_attempt_pid(call.call_id, call.epoch, worker.pid)
        call.probe_next, call.notice = False, None  # sent once (in the prepared run)
        if ARMED:
            failpoint("supervisor.before_dispatch")
        if not self._pool.go(worker):
            self.fence(call, FenceReason.WORKER_DIED)
            return
        log.debug("attempt dispatched to worker %d (pid %d)", worker.worker_id, worker.pid,
                  extra=call_context(call))

    # ---- timers -------------------------------------------------------------
    def next_due(self) -> float | None:
        """When `on_timers` next has something to do (monotonic seconds)."""
        return self._due.next_due()

    def on_timers(self, now: float) -> None:
        """Act on every call whose timer came: a running attempt's stale or
        first-chunk check, a backoff that is over, a deadline."""
        for call_id in self._due.pop_due(now):
            call = self.calls.get(call_id)
            if call is None:
                continue
            if call.state is CallState.RUNNING:
                reason = self._due.check_running(call, now)
                if reason is not None:
                    self.fence(call, reason)
            elif call.state is CallState.BACKOFF:
                call.to(CallEvent.BACKOFF_OVER)
                self._queue.appendleft(call.call_id)
                self._due.arm_deadline(call)
            elif call.state is CallState.QUEUED:
                if call.deadline is not None and now >= call.deadline:
                    self.finish(call, deadline_passed())
                else:
                    self._due.arm_deadline(call)
            # AUTHORIZING, FENCING, FINISHING: the sink's pending reply moves it on.

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
        # (A rebound attempt's answer began at call.content_from.)
        stats = reply if isinstance(reply, AttemptStats) else visible_stats(
            self._transcript_path, call.call_id, call.content_from, call.epoch)
        reason = call.fence_reason
        assert reason is not None, "fenced without a reason"
        if reason is FenceReason.STALE:
            self._verdicts.stale(call)
        worker = self._pool.get(call.worker_id)
        if worker is not None and worker.token == call.token:
            if ARMED:
                failpoint("supervisor.after_fence")
            # Fenced first, so the kill cannot lose an accepted delta.
            self._pool.kill(worker, stalled=reason is FenceReason.STALE)
            self._pool.maintain()
        self._journal.end_attempt(call.call_id, call.epoch, reason.value, None,
                                  stats.visible_chars, stats.accepted)
        if reason is FenceReason.CLUSTER_LOST:
            self._ends.moved(call)
            return
        self._decide(call, stats, None, fence_error(reason, call.timeouts.stale_s))

    def on_ended(self, ended: Ended) -> None:
        """The sink accepted an attempt's final message."""
        call = self.calls.get(ended.call_id)
        if call is None or call.epoch != ended.attempt:
            return
        self._fallbacks.learn(call.profile.name, ended.outcome)
        if call.state is CallState.FENCING:
            call.ended = (ended.stats, ended.outcome)  # decided when the fence reply arrives
            return
        if call.state is not CallState.RUNNING:
            return
        self._journal.end_attempt(call.call_id, call.epoch, "ended", ended.outcome,
                                  ended.stats.visible_chars)
        self._decide(call, ended.stats, ended.outcome, ended.outcome.error)

    def on_lost(self, lost: Lost) -> None:
        """Cluster mode: the cluster refused the attempt's run (another host
        opened a later epoch): the attempt is fenced at the sink already; its
        worker is killed and the call forgotten here."""
        call = self.calls.get(lost.call_id)
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
        call = self.calls.get(refused.call_id)
        if call is not None and call.epoch == refused.attempt and call.state is CallState.RUNNING:
            log.warning("final message refused by the sink: %s", refused.reason,
                        extra=call_context(call))
            self.fence(call, FenceReason.FINAL_REFUSED)

    def on_final_unaccepted(self, call_id: str, token: int) -> None:
        """The run's worker went idle without the sink accepting its final (the
        sink refused it, or told the worker its attempt was over): nothing
        more will come of it."""
        call = self.calls.get(call_id)
        if call is not None and call.token == token and call.state is CallState.RUNNING:
            log.warning("the worker ended the attempt without an accepted final",
                        extra=call_context(call))
            self.fence(call, FenceReason.FINAL_REFUSED)

    def on_worker_exit(self, call_id: str | None, token: int, returncode: int) -> None:
        call = self.calls.get(call_id or "")
        if call is None or call.token != token:
            return
        if call.state is CallState.RUNNING:
            log.warning("worker died mid-attempt (exit %s)", exit_text(returncode),
                        extra=call_context(call))
            self.fence(call, FenceReason.WORKER_DIED)

    def _decide(self, call: Call, stats: AttemptStats, outcome: AttemptOutcome | None,
                error: AttemptError | None) -> None:
        self._counters["attempts." + attempt_outcome(outcome, call.fence_reason)] += 1
        self.histograms.attempt_ended(outcome)
        verdict = self._verdicts.judge(call, stats, outcome, error)
        if isinstance(verdict, Finish):
            self.finish(call, verdict)
            return
        log.info("retrying after %.2fs: %s", verdict.delay, verdict.why,
                 extra=call_context(call))
        call.retry_at = verdict.retry_at
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

    def _finished(self, call: Call, reply: FinishReply) -> None:
        if isinstance(reply, SinkLost) and call.finishing is not None:
            # Ask the restarted sink again (a repeated finish is idempotent there).
            self._send_finish(call, call.finishing)
            return
        if isinstance(reply, Refused) and reply.reason.startswith("cluster_lost"):
            self._ends.moved(call)  # the cluster refused its done: another host owns the call
            return
        if not isinstance(reply, Finished):
            log.error("sink refused to finish the call: %s", why(reply),
                      extra=call_context(call))
            return
        call.to(CallEvent.FINISHED)
        self._journal.refused_deltas(call.call_id, reply.refused)
        self._ends.done(call, reply.done)

    # ---- the sink died ---------------------------------------------------------
    def on_sink_restart(self) -> None:
        """The sink died: its running attempts are rebound (streamfence.supervisor.rebind)."""
        self._rebinds.on_sink_restart()
