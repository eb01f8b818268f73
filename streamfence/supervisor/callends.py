"""The ways a live call leaves this host: its done event stored (`done`),
another host of the cluster owning it now (`moved`, journaled as
calls.MOVED, with no done), or never accepted (`forget` alone, after the
AttemptDriver's `drop`). `forget` is the only way out of the live calls: a
call's count and its request bytes go back to the budgets there.

The AttemptDriver moves a call to DONE (`CallEvent.FINISHED`) before
`done`; nothing here changes a call's state.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from streamfence.protocol.messages import CallStatus
from streamfence.supervisor.calls import MOVED, Call
from streamfence.supervisor.clients import Clients
from streamfence.supervisor.histograms import Histograms
from streamfence.supervisor.journal import Journal
from streamfence.supervisor.livecalls import LiveCalls, call_context
from streamfence.supervisor.logs import log_with_traceback
from streamfence.supervisor.tracing import CallTracer
from streamfence.supervisor.usage import answered_by
from streamfence.supervisor.watchdog import Watchdog

if TYPE_CHECKING:  # cluster mode only: it brings nats
    from streamfence.supervisor.clusterlink import ClusterLink

log = logging.getLogger("streamfence.attempts")


class CallEnds:
    """Holds no state of its own: removes calls from the AttemptDriver's live
    calls and their timers; counts calls by status and calls moved."""

    def __init__(self, calls: LiveCalls, due: Watchdog, journal: Journal, clients: Clients,
                 counters: Counter[str], histograms: Histograms, clock: Callable[[], float],
                 cluster: ClusterLink | None = None, tracer: CallTracer | None = None) -> None:
        self._calls = calls
        self._due = due
        self._journal = journal
        self._clients = clients
        self._counters = counters
        self._histograms = histograms
        self._clock = clock
        self._cluster = cluster
        self._tracer = tracer

    def done(self, call: Call, done: dict[str, Any]) -> None:
        """The sink stored the call's done event: journal its status and its
        usage, tell the `result` waiters, log its last line, and forget it."""
        status = str(done.get("status"))
        self._journal.finish_call(call.call_id, status)
        record_usage(self._journal, call.call_id, call.owner, *answered_by(call), done)
        self._counters["calls_" + status] += 1
        self._histograms.call_done(call.call_id, self._clock())
        _log_end(call, status)
        self._clients.on_call_done(call.call_id, done,
                                   functools.partial(self._journal.attempts_of, call.call_id))
        if self._tracer is not None:
            self._trace(call, done)
        if self._cluster is not None:
            self._cluster.finished(call.call_id)
        self.forget(call)

    def _trace(self, call: Call, done: dict[str, Any]) -> None:
        """The call's spans; a tracer's failure costs its spans only."""
        assert self._tracer is not None
        try:
            self._tracer.call_done(call, done, self._journal.created_of(call.call_id),
                                   self._journal.attempts_of(call.call_id), time.time())
        except Exception:
            self._counters["tracing_errors"] += 1
            log.exception("tracing: the call's spans were not made", extra=call_context(call))

    def moved(self, call: Call) -> None:
        """Cluster mode: another host owns the call now; this host forgets it
        (its journal says `moved`), without a done."""
        log.warning("call moved to another host of the cluster; forgetting it here",
                    extra=call_context(call))
        self._due.clear(call.call_id)
        self._journal.finish_call(call.call_id, MOVED)
        self._counters["calls_moved"] += 1
        self.forget(call)

    def forget(self, call: Call) -> None:
        """The call is no longer live: its count and its request bytes go back
        to its owner's and the daemon's budgets."""
        self._calls.remove(call)
        self._histograms.forget(call.call_id)
        if self._cluster is not None:
            self._cluster.forget(call.call_id)


def record_usage(journal: Journal, call_id: str, owner: str, profile: str, model: str,
                 done: dict[str, Any]) -> None:
    """Add a finished call's usage (its stored done's) to the sums, in the
    transaction of its `finish_call` (supervisor/usage.py)."""
    response = done.get("response")
    attempts = done.get("attempts")
    journal.usage.record(call_id, owner, profile, model,
                         done.get("status") == CallStatus.FAILED,
                         attempts if type(attempts) is int else 0,
                         response.get("usage") if isinstance(response, dict) else None)


def _log_end(call: Call, status: str) -> None:
    """The call's last line. A failed call's is its only ERROR, with the
    traceback of its last attempt's unexpected exception if one ended it:
    each attempt's failure was one WARNING line without one (its worker's,
    or the fence's), and a call that failed attempts but then completed
    logs no ERROR (ARCHITECTURE §4.9). JSON logs have its status, its
    finish_reason and its error's code as keys."""
    finishing = call.finishing
    error = finishing.error if finishing is not None else None
    said = f": {error['code']}: {error['message']}" if error else ""
    context = call_context(call, status=status, code=error["code"] if error else None,
                           finish_reason=finishing.meta.finish_reason if finishing else None)
    if status == CallStatus.FAILED:
        log_with_traceback(log, logging.ERROR, call.traceback,
                           "call failed after %d attempt(s)%s", call.attempts, said,
                           context=context)
    elif call.traceback is not None:  # partial: text, then an unexpected exception
        log_with_traceback(log, logging.WARNING, call.traceback, "call %s after %d "
                           "attempt(s)%s", status, call.attempts, said, context=context)
    else:
        log.info("call %s after %d attempt(s)%s", status, call.attempts, said, extra=context)
