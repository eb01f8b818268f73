"""Cluster mode: a call this host takes over (ARCHITECTURE §4.17, rule 4),
from a host that lost its lease, or a stray of its own taken up again.

It is journaled here, the sink stores what the call's log holds (C_ADOPT),
and it runs as a recovered call does: under the epoch taken, with a reset
first if anything was delivered. A call this host's journal has ended (its
entry outlived its done) is only released.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from streamfence.config.groups import resolve
from streamfence.config.model import DaemonConfig
from streamfence.protocol.internal.control import AttemptStats
from streamfence.supervisor.callends import CallEnds
from streamfence.supervisor.calls import Call
from streamfence.supervisor.journal import Journal
from streamfence.supervisor.livecalls import LiveCalls, call_context
from streamfence.supervisor.recovery import make_call
from streamfence.supervisor.sinklink import Refused, SinkLink, StatsReply, why

if TYPE_CHECKING:  # cluster mode only: it brings nats
    from streamfence.cluster.ledger import Owner
    from streamfence.supervisor.clusterlink import ClusterLink

log = logging.getLogger("streamfence.attempts")


class Takeover:
    """Holds no state of its own: a call taken over joins the AttemptDriver's
    live calls through its `enqueue` (staged) and runs once `release`d;
    counts calls taken over."""

    def __init__(self, config: DaemonConfig, calls: LiveCalls, journal: Journal, sink: SinkLink,
                 ends: CallEnds, counters: Counter[str], cluster: ClusterLink,
                 enqueue: Callable[[Call, bool], None], release: Callable[[str], None]) -> None:
        self._config = config
        self._calls = calls
        self._journal = journal
        self._sink = sink
        self._ends = ends
        self._counters = counters
        self._cluster = cluster
        self._enqueue = enqueue
        self._release = release

    def use(self, config: DaemonConfig) -> None:
        """A reloaded config (supervisor/reload.py): its profiles for the next call taken."""
        self._config = config

    def adopt(self, owner: Owner, record: dict[str, Any], taken_from: str) -> None:
        """This host took the call over at `owner.epoch` from `taken_from` (the
        host that owned it; this one for a stray); `record`: the call's record
        in the cluster."""
        call_id = owner.call_id
        if self._calls.has(call_id):  # a host that stood still won back a call it runs
            log.info("cluster: call %s taken over at epoch %d runs here already; it goes on",
                     call_id, owner.epoch)
            return
        provider = record.get("provider", "")
        providers, groups = self._config.providers, self._config.groups
        if resolve(provider, providers, groups) is None:
            log.error("cluster: call %s taken over names provider profile or group %r, which "
                      "this host does not have; left as is", call_id, provider)
            return
        if self._journal.is_finished(call_id) and not self._journal.is_moved(call_id):
            log.info("cluster: call %s taken up had ended here; its entry goes", call_id)
            self._cluster.finished(call_id)
            return
        call = make_call(call_id, record["owner"], provider, providers, groups, record["request"],
                         record.get("options") or {}, record.get("session_id"),
                         record.get("idempotency_key"), None, owner.epoch - 1,
                         owner.epoch - 1)
        self._journal.take_back(call_id)  # a call it had moved away: journaled anew
        self._journal.add_call(call_id, call.owner, call.spec.idempotency_key,
                               call.spec.session_id, provider, call.spec.request,
                               call.spec.options.to_map())
        self._journal.taken_over(call_id, taken_from, owner.epoch)
        self._enqueue(call, True)  # staged: it runs once the sink holds its log
        self._counters["calls_taken_over"] += 1
        log.warning("cluster: call taken over at epoch %d", owner.epoch, extra=call_context(call))
        self._sink.adopt(call_id, owner.epoch, functools.partial(self._adopted, call))

    def _adopted(self, call: Call, reply: StatsReply) -> None:
        if self._calls.get(call.call_id) is not call:
            return
        if isinstance(reply, AttemptStats):
            call.delivered = reply.last_seq > 0  # a reset first: §4.10's rule
            self._release(call.call_id)
            return
        if isinstance(reply, Refused) and reply.reason.startswith("call_finished"):
            status = reply.reason.partition(": ")[2] or "completed"
            log.info("cluster: the call taken over had ended (%s)", status,
                     extra=call_context(call))
            self._journal.finish_call(call.call_id, status)
            self._cluster.finished(call.call_id)
            self._ends.forget(call)
            return
        log.error("cluster: the sink could not take the call's log: %s", why(reply),
                  extra=call_context(call))
        self._ends.moved(call)
