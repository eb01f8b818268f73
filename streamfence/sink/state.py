"""The sink's state, one owner per job (no sockets here): `SinkState` builds
them, dispatches the supervisor's control ops to them and gathers their
stats. `process.Sink` owns the sockets and the loop, `intake.WorkerIntake`
the per-delta hot path, which works on `calls` and `commits` directly.

| job | module (owner) | its state |
| --- | --- | --- |
| the calls known, their fence entries | calls.py (`Calls`) | fence table, LiveCalls, finished calls |
| input counts, refusal logs | counters.py (`Counters`) | accepted, dropped, bad frames, finals |
| group commits, durable before visible | commits.py (`Commits`) | dirty calls, schedule, outbox |
| retention | retention.py (`Retention`) | when the next prune is due |
| authorize, fence, finish, finals | fencing.py (`Fencing`) | none of its own |
| rebinds after a restart (§2.8) | rebinds.py (`Rebinds`) | rebinds not asked for, waiting hellos |
| replays to listeners | replays.py (`Replays`) | replays in progress |
| cluster mode (§4.17) | replica.py (`Replica`), log_queue.py (`LogQueue`) | the ClusterLog, followed calls; what waits for the calls' logs |

Messages to the supervisor go through the `Publisher` it is given
(`peer.SupervisorPeer`), the calls' events to their listeners through
`Listeners` (`subscribers.Subscribers`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from streamfence.protocol.internal.control import (
    AddSubscriber,
    Adopt,
    Authorize,
    ControlOp,
    Fence,
    Finish,
    Follow,
    Rebind,
    Stats,
    encode_ok,
    encode_refused,
)
from streamfence.sink.calls import Calls
from streamfence.sink.commits import Commits
from streamfence.sink.counters import Counters
from streamfence.sink.fencing import Fencing
from streamfence.sink.listeners import Listeners
from streamfence.sink.peer import Publisher
from streamfence.sink.rebinds import Rebinds
from streamfence.sink.replays import Replays
from streamfence.sink.replica import Replica
from streamfence.sink.retention import Retention
from streamfence.sink.store import TranscriptStore

if TYPE_CHECKING:  # imported by the sink only in cluster mode (it brings nats)
    from streamfence.sink.cluster_log import ClusterLog


class SinkState:
    """Holds the owners of the sink's state (module docstring)."""

    def __init__(self, store: TranscriptStore, peer: Publisher, listeners: Listeners,
                 retention_days: float = 0.0, cluster: ClusterLog | None = None) -> None:
        self.store = store
        self.peer = peer
        self.listeners = listeners
        self.calls = Calls(store)
        self.counters = Counters(self.calls)
        self.commits = Commits(store, self.calls, listeners)
        self.retention = Retention(store, self.commits, retention_days)
        self.replica: Replica | None = None
        if cluster is not None:  # the calls' logs, written first (§4.17)
            self.replica = Replica(cluster, store, self.calls, self.commits, peer)
        self.fencing = Fencing(store, self.calls, self.commits, self.counters, peer,
                               self.replica)
        self.rebinds = Rebinds(store, self.calls, self.commits, self.replica)
        self.replays = Replays(store, self.calls, self.commits, listeners)

    def handle_control(self, op: ControlOp, reply: Callable[[bytes], object]) -> None:
        """Run one control op; `reply(the encoded reply)`, at once or, in cluster
        mode, once the call's log allows (sink/fencing.py). An op of a call
        whose earlier op waits for its log waits behind it, in order."""
        # Commit (and so publish) what is accepted first: a reply never
        # overtakes the events it reports on. Stats do not wait out a storage
        # fault, so that `status` shows it while it lasts (sink/store.py).
        if isinstance(op, Stats):
            self.commits.commit(wait=False)
            reply(encode_ok(op.req, self.stats()))
            return
        self.commits.commit()
        if self.replica is not None and not isinstance(op, AddSubscriber) \
                and self.replica.queue.parked(op.call_id):
            self.replica.queue.after_stored(op.call_id, lambda: self._run(op, reply))
            return
        self._run(op, reply)

    def _run(self, op: ControlOp, reply: Callable[[bytes], object]) -> None:
        if isinstance(op, (Authorize, Fence, Finish)):
            self.rebinds.settled(op.call_id)  # the supervisor decided the call otherwise
        if isinstance(op, Authorize):
            self.fencing.authorize(op, reply)
        elif isinstance(op, Fence):
            self.fencing.fence(op, reply)
        elif isinstance(op, Finish):
            self.fencing.finish(op, reply)
        elif isinstance(op, Rebind):
            self.rebinds.rebind(op, reply)
        elif isinstance(op, (Adopt, Follow)):
            if self.replica is None:
                reply(encode_refused(op.req, "not in cluster mode"))
            elif isinstance(op, Adopt):
                self.replica.adopt(op, reply)
            else:
                self.replica.follow(op, reply)
        elif not isinstance(op, Stats):
            reply(self.replays.subscribe(op))

    def stats(self) -> dict[str, Any]:
        counters, commits, store = self.counters, self.commits, self.store
        return {
            "accepted": counters.accepted,
            "dropped": counters.dropped,
            "dropped_by_verdict": {v.value: n for v, n in counters.dropped_by.items()},
            "dropped_by_call": counters.dropped_by_call(),
            "bad_frames": dict(counters.bad_frames),
            "finals_accepted": counters.finals_accepted,
            "finals_refused": counters.finals_refused,
            "calls_in_memory": len(self.calls.lives),
            "calls_open": self.calls.open_count(),
            "db_rows": store.rows_written,
            "commits": store.commits,
            "wal_rewinds": store.wal_rewinds,  # sink/store.py `_rewind_wal`
            "calls_pruned": store.pruned,
            "pending_events": commits.pending_events,
            "acks_unroutable": counters.acks_unroutable,
            "attempts_rebound": self.rebinds.count,
            "subscribed_calls": sum(1 for lv in self.calls.lives.values() if lv.subs),
            "replays": len(self.replays.active),
            "replays_damaged": self.replays.damaged,  # ended by a read that failed
            # The storage fault the store is waiting out (sink/store.py), if
            # any: SQLite's error and since when (wall clock); and how many
            # writes were tried again after one, since the start.
            "storage_fault": store.fault,
            "storage_fault_since": store.fault_since,
            "storage_retries": store.retries,
            "delta_latency": commits.delta_latency.to_map(),
            **(self.replica.stats() if self.replica is not None else {}),
            **self.peer.stats(),
            **self.listeners.stats(),
        }
