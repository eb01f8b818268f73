"""The sink died and restarts: every attempt still running goes on under a
new epoch at the new sink (docs/ARCHITECTURE.md §2.8). Its worker keeps its
provider stream; the new epoch is journaled (durable) first, as any, and in
cluster mode owned first (§4.17); the call stays RUNNING meanwhile. An
attempt the new sink or the cluster will not rebind is fenced, and the
AttemptDriver decides it as any fenced attempt.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from streamfence.protocol.failpoints import ARMED, failpoint
from streamfence.protocol.internal.control import AttemptStats
from streamfence.protocol.states import CallState, FenceReason
from streamfence.supervisor.calls import Call
from streamfence.supervisor.journal import Journal
from streamfence.supervisor.livecalls import LiveCalls, call_context
from streamfence.supervisor.pool import Pool
from streamfence.supervisor.sinklink import SINK_LOST, SinkLink, StatsReply, why

if TYPE_CHECKING:  # cluster mode only: it brings nats
    from streamfence.supervisor.clusterlink import ClusterLink

log = logging.getLogger("streamfence.attempts")


class Rebinds:
    """Holds no state of its own: the calls are the AttemptDriver's, which
    hands in its `fence`. Moves a running call's epoch on (never its state);
    counts the attempts rebound."""

    def __init__(self, calls: LiveCalls, journal: Journal, pool: Pool, sink: SinkLink,
                 counters: Counter[str], fence: Callable[[Call, FenceReason], None],
                 cluster: ClusterLink | None = None) -> None:
        self._calls = calls
        self._journal = journal
        self._pool = pool
        self._sink = sink
        self._counters = counters
        self._fence = fence
        self._cluster = cluster

    def on_sink_restart(self) -> None:
        """Fail the requests the dead sink never answered, then rebind every
        attempt still running (docs/ARCHITECTURE.md §2.8): its worker keeps its
        provider stream and goes on under a new epoch at the new sink, from
        what the transcript holds. The new epochs are durable first, as for
        any attempt; the call stays RUNNING meanwhile (a fence sent after the
        rebind closes the new epoch)."""
        self._sink.fail_pending()
        rebound = []
        for call in list(self._calls):
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
            if call.epoch != old + 1 or call.state is not CallState.RUNNING:
                # Decided meanwhile, or the sink died again before this epoch
                # was durable: the later restart's rebind (from it) is the one.
                continue
            if self._cluster is not None:  # the new epoch is owned first, as any (§4.17)
                self._cluster.take(call.call_id, call.epoch, functools.partial(
                    self._rebind_owned, call, call.epoch, old))
            else:
                self._rebind_at_sink(call, old)

    def _rebind_at_sink(self, call: Call, old: int) -> None:
        if ARMED:
            failpoint("supervisor.before_rebind")
        self._sink.rebind(call.call_id, call.epoch, old, call.content_from, call.token,
                          functools.partial(self._rebound, call, call.epoch))

    def _rebind_owned(self, call: Call, epoch: int, old: int, result: bool | str) -> None:
        if call.epoch != epoch or call.state is not CallState.RUNNING:
            return
        if result is True:
            self._rebind_at_sink(call, old)
        else:
            self._fence(call, FenceReason.CLUSTER_LOST if result is False
                       else FenceReason.SINK_RESTARTED)

    def _rebound(self, call: Call, epoch: int, reply: StatsReply) -> None:
        if call.epoch != epoch or call.state is not CallState.RUNNING:
            return  # fenced or ended meanwhile: that path decides
        if reply is SINK_LOST:
            return  # the sink died again: on_sink_restart rebinds it again
        if not isinstance(reply, AttemptStats):
            log.warning("the restarted sink refused to rebind the attempt: %s", why(reply),
                        extra=call_context(call))
            self._fence(call, FenceReason.SINK_RESTARTED)
            return
        self._counters["attempts_rebound"] += 1
        log.info("the sink restarted: the attempt goes on as attempt %d after seq %d",
                 epoch, reply.last_seq, extra=call_context(call))

