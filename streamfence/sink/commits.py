"""Group commits: accepted events become durable, then visible.

`Commits` owns the commit schedule and what waits for the next commit:

- `dirty`: the calls whose LiveCall holds pending events (the hot path
  appends a call when its first pending event comes; `flush_pending` turns
  each call's pending events into one stored run);
- `pending_events` and `commit_due`, which the loop reads to commit at
  `COMMIT_EVERY` events, `COMMIT_AFTER_S` after the first pending one, or
  as soon as the input runs dry: a commit takes what came while the one
  before it ran, so under load commits grow by themselves and a delta
  waits about one commit, never a timer (a gap between commits, with the
  poll's whole-millisecond timeout, held 1.5-3 % of the commits at 20k
  deltas/s over 1 ms);
- `outbox`: runs of accepted events waiting, with their call's listeners,
  for the commit that stores them (one entry per call per commit, made by
  `flush_pending`).

Durable before visible: every event is handed to its listeners after the
commit that stores it, and every ack or reply after the commit covering
what it reports. So whatever a client has seen survives a kill -9 of the
whole daemon, and a restarted sink never re-uses a seq. In cluster mode the
calls' logs take each commit's rows first (`replicate`: sink/log_queue.py),
and what must follow a call's stored rows waits for them (`after_stored`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgpack

from streamfence.protocol.failpoints import ARMED, failpoint
from streamfence.protocol.histograms import DELTA_LATENCY_BUCKETS, Histogram
from streamfence.sink.calls import Calls, LiveCall
from streamfence.sink.listeners import Cuts, Listeners, Outbox
from streamfence.sink.store import TranscriptStore

Step = Callable[[], None]
COMMIT_EVERY = 1000  # events per group commit ...
COMMIT_AFTER_S = 0.005  # ... or this long after the first uncommitted one, or when idle


class Commits:
    """Owns the commit schedule, the dirty calls, the outbox and the delta
    latency histogram. The hot path (sink/intake.py) appends to `dirty`
    through a bound append: it is only ever cleared in place, as `outbox` is
    (cluster mode's `replicate` rewrites it in place)."""

    def __init__(self, store: TranscriptStore, calls: Calls, listeners: Listeners) -> None:
        self.store = store
        self._calls = calls
        self._listeners = listeners
        self.dirty: list[LiveCall] = []
        self.pending_events = 0
        self.commit_due: float | None = None
        self.outbox: Outbox = []  # runs waiting for their commit, with their listeners
        # Cluster mode: the calls' logs take the commit's rows first, and a step that
        # must follow a call's stored rows waits for them (sink/log_queue.py).
        self.replicate: Callable[[], None] | None = None
        self.after_stored: Callable[[str, Step], None] = lambda call_id, step: step()
        self.waits: Callable[[str], bool] = lambda call_id: False  # rows wait for its log
        # Per commit that stored deltas (never per delta): see `commit`.
        self.delta_latency = Histogram(DELTA_LATENCY_BUCKETS)

    def flush_pending(self) -> None:
        """Each dirty call's pending events to the store as one run, and the
        run, whole, to the outbox when the call has listeners (sent after the
        commit): per call, not per delta."""
        add_run, outbox_append = self.store.add_run, self.outbox.append
        for live in self.dirty:
            pending = live.pending
            if pending:
                add_run(live.call_id, live.pending_seq, live.attempt, pending)
                live.content.stored(pending)  # the answer held in memory is bounded
                if live.subs:
                    outbox_append((live.subs, pending))
                live.pending = []
        self.dirty.clear()

    def commit(self, wait: bool = True) -> bool:
        """Store everything accepted so far, then publish its events. A storage
        fault is waited out in the store; with `wait` False it is not: then
        nothing is stored or published, all stays pending, and False.

        `delta_latency` (status `histograms`, docs/METRICS.md): when deltas
        were pending, from the end of the loop turn that read the first of
        them (`commit_due` is set then) or, for a commit in that same turn
        (a final's, a control op's), from this call, to the hand-off of
        their events to the listeners' sockets: the oldest delta's wait."""
        since = (self.commit_due - COMMIT_AFTER_S if self.commit_due is not None
                 else time.monotonic()) if self.pending_events else None
        self.flush_pending()
        if self.replicate is not None:
            self.replicate()
        if self.store.commit(wait) is None:
            return False
        self.pending_events = 0
        self.commit_due = None
        if self.outbox:
            self.deliver(self.outbox)
            self.outbox.clear()
        if since is not None:
            self.delta_latency.observe(time.monotonic() - since)
        return True

    def deliver(self, events: Outbox) -> None:
        """Events whose rows are stored, to their listeners."""
        if ARMED:
            failpoint("sink.after_commit")
        cuts = self._listeners.deliver(events)
        if cuts:
            self._cut_off(cuts)

    def send_event(self, subs: set[bytes], event: bytes) -> None:
        """One event (a reset, a done) to a call's listeners, after its commit."""
        if subs:
            cuts = self._listeners.deliver([(subs, [event])])
            if cuts:
                self._cut_off(cuts)

    def _cut_off(self, cuts: Cuts) -> None:
        """Listeners that had no room for events: each stops following those
        calls and is told the last seq it was sent (a rare path: decode)."""
        for listener, events in cuts:
            first: dict[str, int] = {}
            for body in events:
                event = msgpack.unpackb(body)
                first.setdefault(event["call_id"], event["seq"])
            for call_id, seq in first.items():
                live = self._calls.lives.get(call_id)
                if live is not None:
                    live.subs.discard(listener)
                self._listeners.cut_off(listener, call_id, seq - 1)
