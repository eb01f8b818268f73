"""The sink's state and its out-of-line operations (no sockets here).

`SinkState` owns the fence table, one `LiveCall` per known call, the
transcript store, the commit schedule and the counters. It implements the
control ops (authorize / fence / rebind / finish / stats / subscribe), worker
finals and hellos,
drop accounting and commits; it sends the calls' events to their listeners
through `subscribers.Subscribers` and attempt endings to the supervisor
through the `Publisher` it is given (`peer.SupervisorPeer`); `process.Sink`
owns the sockets, the loop and the per-delta hot path.

Invariants:
- every call in the fence table has a LiveCall (created and evicted together);
- a LiveCall's `pending` holds accepted events not yet handed to the store,
  and the calls with pending events are listed in `dirty` (the hot path
  appends; `flush_pending` turns each into one row per call);
- durable before visible: an accepted event waits in `outbox` (with its call's
  listeners) until the commit that stores it, and every ack, reply or event
  is sent after the commit covering what it reports. So whatever a client has seen survives a
  kill -9 of the whole daemon, and a restarted sink never re-uses a seq.

Retention (`[daemon] retention_days`, passed at spawn; 0: keep forever): the
sink prunes its own file, the only writer that it is. `prune` (called by the
loop when `prune_due` has come) commits what is pending, then deletes one
batch of finished calls in one transaction: at most `store.PRUNE_BATCH`, and
none after `PRUNE_BUDGET_S` spent, so deltas wait a few milliseconds at most;
the next batch is due `PRUNE_EVERY_S` later, or `PRUNE_BACKLOG_S` while
finished calls are still due. The first batch waits `PRUNE_FIRST_S` after
start (the supervisor's recovery reads the transcript then). The transcript
keeps a finished call a little longer than the journal (`prune_grace_s`: a
quarter of the retention, at most a minute), so a call the journal still
knows always has its events.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import msgpack

from streamfence.cluster.records import EVENTS
from streamfence.protocol.codec import encode
from streamfence.protocol.internal.control import (
    FROM_NOW,
    AddSubscriber,
    Adopt,
    AttemptStats,
    Authorize,
    ControlOp,
    Fence,
    Finish,
    Follow,
    Rebind,
    Stats,
    encode_ended,
    encode_final_refused,
    encode_followed_done,
    encode_lost,
    encode_ok,
    encode_refused,
    stats_to_wire,
)
from streamfence.protocol.internal.worker_wire import (
    Final,
    Hello,
    final_ack_frame,
    rebind_frame,
)
from streamfence.protocol.messages import done_event, reset_event
from streamfence.sink.content import Content
from streamfence.sink.event_pieces import delta_prefix
from streamfence.sink.fence import AuthorizeRefusal, FenceTable, FinalVerdict, Verdict
from streamfence.sink.store import TranscriptStore, split_events
from streamfence.sink.subscribers import Cuts, Outbox
from streamfence.supervisor.histograms import DELTA_LATENCY_BUCKETS, Histogram

if TYPE_CHECKING:  # imported by the sink only in cluster mode (it brings nats)
    from streamfence.sink.cluster_log import ClusterLog

log = logging.getLogger("streamfence.sink")
fence_log = logging.getLogger("streamfence.sink.fence")

COMMIT_EVERY = 1000  # events per group commit ...
COMMIT_AFTER_S = 0.005  # ... or this long after the first uncommitted one ...
IDLE_COMMIT_GAP_S = 0.0002  # ... or when the input runs dry, at most once per this
FINISHED_KEEP = 10_000  # finished calls kept in memory (late drops stay attributed)
UNKNOWN_DROP_KEYS = 4096  # (call, attempt) pairs of unknown calls tracked for logging
WARN_EVERY_S = 10.0  # bad frames: at most one WARNING per socket per interval
PRUNE_BUDGET_S = 0.003  # retention: time spent deleting per transaction, at most ...
PRUNE_EVERY_S = 5.0  # ... between prune transactions ...
PRUNE_BACKLOG_S = 0.05  # ... or this, while finished calls are still due
PRUNE_FIRST_S = 10.0  # the first one this long after start
PRUNE_GRACE_MAX_S = 60.0
REPLAY_BUDGET_S = 0.002  # replays: time spent per loop turn, at most ...
REPLAY_ROWS = 8  # ... in slices of this many stored rows (each up to COMMIT_EVERY events)


def prune_grace_s(retention_s: float) -> float:
    """How much longer than the journal the transcript keeps a finished call."""
    return min(PRUNE_GRACE_MAX_S, retention_s / 4)

# One grep-able prefix for every refusal: "fence: dropped delta".
_DROP_WHY = {
    Verdict.STALE_ATTEMPT: "from superseded attempt",
    Verdict.FUTURE_ATTEMPT: "from unauthorized attempt",
    Verdict.UNKNOWN_CALL: "for unknown call",
    Verdict.CLOSED: "from closed attempt",
    Verdict.GAP: "with seq gap",
    Verdict.DUPLICATE: "with duplicate seq",
}
_SEQ_VERDICTS = (Verdict.GAP, Verdict.DUPLICATE)


class Publisher(Protocol):
    """Where the sink's messages to the supervisor go (`peer.SupervisorPeer`)."""

    def publish(self, frame: bytes) -> None: ...

    def stats(self) -> dict[str, int]: ...


class Listeners(Protocol):
    """Where the calls' events go (`subscribers.Subscribers`)."""

    def deliver(self, outbox: Outbox) -> Cuts: ...

    def replay(self, listener: bytes, events: list[bytes]) -> int: ...

    def room(self, listener: bytes) -> int: ...

    def cut_off(self, listener: bytes, call_id: str, seq: int) -> None: ...

    def stats(self) -> dict[str, int]: ...


class Replay:
    """A listener's replay of one call from the transcript, served in slices
    (`SinkState.serve_replays`): `seq` is the last seq sent; `follow`: join the
    live feed once caught up, if the call has not ended."""

    __slots__ = ("follow", "seq")

    def __init__(self, seq: int, follow: bool) -> None:
        self.seq = seq
        self.follow = follow


class LiveCall:
    """One call's runtime state beside its fence entry: public seq, the current
    attempt's content, events accepted but not yet stored, drops per attempt."""

    __slots__ = ("add", "attempt", "call_id", "content", "drops", "model",
                 "pending", "pending_seq", "prefix", "seq", "subs")

    def __init__(self, call_id: str, last_seq: int) -> None:
        self.call_id = call_id
        self.seq = last_seq  # last public event seq of the call (across attempts)
        self.attempt = 0  # attempt whose content is held (0: none yet)
        self.content = Content()
        self.add = self.content.add
        self.prefix = b""  # encoded delta event up to "seq" for (call, attempt)
        self.subs: set[bytes] = set()  # the listeners following the call
        self.pending: list[bytes] = []
        self.pending_seq = 0  # public seq of pending[0]
        self.drops: dict[int, int] = {}  # attempt -> refused deltas carrying it
        self.model: str | None = None

    def start_attempt(self, attempt: int, model: str | None) -> None:
        self.attempt = attempt
        self.content = Content()
        self.add = self.content.add
        self.prefix = delta_prefix(self.call_id, attempt)
        self.model = model

    def continue_attempt(self, attempt: int, shown_as: int) -> None:
        """`attempt` writes on the same answer (a rebind): the content stays,
        and its events keep the attempt number `shown_as` that began it (one
        provider attempt is one attempt to a subscriber, whatever its epochs)."""
        self.attempt = attempt
        self.prefix = delta_prefix(self.call_id, shown_as)

    def stats(self, closed: bool) -> AttemptStats:
        c = self.content
        accepted = c.deltas()  # seqs are contiguous from 1
        return AttemptStats(self.attempt, accepted, self.drops.get(self.attempt, 0),
                            c.visible_chars(), c.tool_fragments(), accepted, closed)


class SinkState:
    """Owns the fence table, the LiveCalls, the transcript store, the commit
    schedule (`pending_events`, `commit_due`, `last_commit`, `outbox`) and the
    counters. The hot path in process.py works on these directly, by design."""

    def __init__(self, store: TranscriptStore, peer: Publisher, listeners: Listeners,
                 retention_days: float = 0.0, cluster: ClusterLog | None = None) -> None:
        self.store = store
        self.cluster = cluster  # cluster mode: the calls' logs, written first (§4.17)
        self.followed: dict[str, int] = {}  # calls another host runs -> the epoch read last
        self.peer = peer
        self.listeners = listeners
        self.retention_s = max(0.0, retention_days) * 86400.0
        # monotonic time of the next prune transaction (None: retention is off)
        self.prune_due: float | None = (time.monotonic() + PRUNE_FIRST_S
                                        if self.retention_s > 0 else None)
        self.fence = FenceTable()
        self.lives: dict[str, LiveCall] = {}
        self.dirty: list[LiveCall] = []
        self.pending_events = 0
        self.commit_due: float | None = None
        self.last_commit = 0.0
        self.outbox: Outbox = []  # events waiting for their commit, with their listeners
        self.replays: dict[tuple[bytes, str], Replay] = {}  # (listener, call_id) -> its replay
        self.finished: deque[str] = deque()
        self.pack = msgpack.Packer(use_bin_type=True, datetime=False).pack
        self.accepted = 0
        self.dropped = 0
        self.dropped_by: dict[Verdict, int] = {v: 0 for v in Verdict if v is not Verdict.ACCEPT}
        self.unknown_drops: dict[tuple[str, int], int] = {}
        self.bad_frames = {"in": 0, "ctl": 0}
        self._bad_warned = {"in": -WARN_EVERY_S, "ctl": -WARN_EVERY_S}
        # After a restart (ARCHITECTURE §2.8): per call, the rebind the
        # supervisor made that its worker has not asked for yet, and the
        # worker's hello that came before it.
        self.rebinds: dict[str, tuple[Rebind, int]] = {}  # call -> (op, resume_after)
        self.hellos: dict[str, tuple[Hello, Callable[[bytes], bool]]] = {}
        self.rebound = 0
        self.finals_accepted = 0
        self.finals_refused = 0
        self.acks_unroutable = 0  # finals whose worker left before its ack
        # Per commit that stored deltas (never per delta): see `commit`.
        self.delta_latency = Histogram(DELTA_LATENCY_BUCKETS)
        self.prune_failing = False  # the last prune failed (logged once until one works)
        for row in store.unfinished_calls():
            # Closed until the supervisor authorizes a higher epoch.
            self.fence.seed(row.call_id, row.max_epoch)
            live = self.lives[row.call_id] = LiveCall(row.call_id, row.last_seq)
            self._restore_content(live, row.max_epoch)
        if self.lives:
            log.info("sink: rebuilt %d unfinished calls from %s", len(self.lives), store.path)

    def _restore_content(self, live: LiveCall, epoch: int, since: int | None = None) -> None:
        """Reload the content of the answer attempt `epoch` writes from the
        store (after a restart), so its stats (visible_chars above all) tell
        the supervisor what was delivered. With `since`: a rebind, the answer
        that attempts `since`..`epoch` wrote together (its events carry
        `since`). Without: the deltas after the last reset of the newest
        attempt number among them; a rebound answer's all carry the one that
        began it, where the store's epoch alone would find none."""
        if epoch < 1:
            return
        live.start_attempt(epoch, None)
        deltas: list[tuple[dict[str, Any], bytes]] = []
        for body in self.store.events_after(live.call_id, 0):
            event = msgpack.unpackb(body)
            if event["op"] == "reset":
                deltas.clear()
            elif event["op"] == "delta":
                deltas.append((event, body))
        newest = max((e["attempt"] for e, _ in deltas), default=0)
        for event, body in deltas:
            if (since <= event["attempt"] <= epoch) if since is not None \
                    else event["attempt"] == newest:
                live.add[event["kind"]](event["data"])
                live.content.stored([body])

    # ---- calls -------------------------------------------------------------------

    def _live(self, call_id: str) -> LiveCall:
        """The call's LiveCall, reloaded from the store or created when unknown."""
        live = self.lives.get(call_id)
        if live is None:
            row = self.store.call_row(call_id)
            live = LiveCall(call_id, row.last_seq if row else 0)
            self.lives[call_id] = live
            if row is not None:
                finished = row.status is not None
                self.fence.seed(call_id, row.max_epoch, finished)
                if finished:
                    self._remember_finished(call_id)
        return live

    def _remember_finished(self, call_id: str) -> None:
        self.finished.append(call_id)
        while len(self.finished) > FINISHED_KEEP:
            old = self.finished.popleft()
            self.fence.evict(old)
            self.lives.pop(old, None)

    # ---- commits -------------------------------------------------------------------

    def flush_pending(self) -> None:
        for live in self.dirty:
            if live.pending:
                self.store.add_run(live.call_id, live.pending_seq, live.attempt, live.pending)
                live.content.stored(live.pending)  # the answer held in memory is bounded
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
        if self.cluster is not None:
            self._replicate(self.cluster)
        if self.store.commit(wait) is None:
            return False
        self.pending_events = 0
        self.commit_due = None
        self.last_commit = time.monotonic()
        if self.outbox:
            cuts = self.listeners.deliver(self.outbox)
            self.outbox.clear()  # in place: the hot path holds a bound append
            if cuts:
                self._cut_off(cuts)
        if since is not None:
            self.delta_latency.observe(time.monotonic() - since)
        return True

    def _replicate(self, cluster: ClusterLog) -> None:
        """Cluster mode: the calls' logs take the commit's rows first; the runs
        of calls another host took are dropped here (never stored, never sent),
        their attempts fenced, and the supervisor told (E_LOST)."""
        rows = self.store.unreplicated()
        if not rows:
            return
        moved = cluster.replicate(rows)
        self.store.replicated_but(moved)
        if not moved:
            return
        lost = {id(self.lives[c].subs) for c in moved if c in self.lives}
        self.outbox[:] = [entry for entry in self.outbox if id(entry[0]) not in lost]
        for call_id in moved:
            view = self.fence.view(call_id)
            epoch = view.epoch if view is not None else 0
            if view is not None and view.open:
                self.fence.fence(call_id, epoch)
            self.peer.publish(encode_lost(call_id, epoch, "another host owns the call now"))

    def _send_event(self, subs: set[bytes], event: bytes) -> None:
        """One event (a reset, a done) to a call's listeners, after its commit."""
        if subs:
            cuts = self.listeners.deliver([(subs, event)])
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
                live = self.lives.get(call_id)
                if live is not None:
                    live.subs.discard(listener)
                self.listeners.cut_off(listener, call_id, seq - 1)

    # ---- retention -------------------------------------------------------------------

    def prune(self) -> int:
        """One retention batch (see the module docstring); returns the calls deleted.
        Their LiveCalls, if still in memory, stay: finished, they refuse everything."""
        now = time.monotonic()
        self.prune_due = now + PRUNE_EVERY_S
        if self.pending_events:
            self.commit()  # publish what is accepted before the delete's time is spent
        older_than = time.time() - self.retention_s - prune_grace_s(self.retention_s)
        try:
            removed = self.store.prune(older_than, budget_s=PRUNE_BUDGET_S)
        except sqlite3.OperationalError as exc:  # a storage fault, say: not waited out here
            if not self.prune_failing:  # once per run of failures: a full disk fails each try
                log.warning("sink: pruning finished calls from %s failed (tried again every "
                            "%g s): %s (%s)", self.store.path, PRUNE_EVERY_S,
                            exc.sqlite_errorname, exc)
            self.prune_failing = True
            return 0
        if self.prune_failing:
            self.prune_failing = False
            log.info("sink: pruning finished calls from %s works again", self.store.path)
        if self.store.prune_more:
            self.prune_due = now + PRUNE_BACKLOG_S
        if removed:
            log.debug("sink: pruned %d finished calls in %.1f ms", removed,
                      (time.monotonic() - now) * 1000)
        return removed

    # ---- control ops ---------------------------------------------------------------

    def handle_control(self, op: ControlOp) -> bytes:
        """Run one control op; returns the encoded reply."""
        # Commit (and so publish) what is accepted first: a reply never
        # overtakes the events it reports on. Stats do not wait out a storage
        # fault, so that `status` shows it while it lasts (sink/store.py).
        if isinstance(op, Stats):
            self.commit(wait=False)
            return encode_ok(op.req, self.stats())
        self.commit()
        if isinstance(op, Authorize):
            return self._authorize(op)
        if isinstance(op, Fence):
            return self._fence(op)
        if isinstance(op, Rebind):
            return self._rebind(op)
        if isinstance(op, Finish):
            return self._finish(op)
        if isinstance(op, Adopt):
            return self._adopt(op)
        if isinstance(op, Follow):
            return self._follow(op)
        return self._add_subscriber(op)

    def _authorize(self, op: Authorize) -> bytes:
        self._rebind_settled(op.call_id)
        live = self._live(op.call_id)
        prev = live.stats(closed=True)
        view = self.fence.view(op.call_id)
        if self.cluster is not None and (view is None or op.attempt > view.epoch) \
                and not (view is not None and view.finished):
            first = not self.cluster.holds(op.call_id)
            if op.log_seq:  # the supervisor opened the epoch in the log (§4.17)
                self.cluster.hold(op.call_id, op.attempt, op.log_seq)
            else:
                lost = self.cluster.open(op.call_id, op.attempt)  # the log first
                if lost is not None:
                    log.info("sink: authorize refused call=%s attempt=%d: %s", op.call_id,
                             op.attempt, lost)
                    return encode_refused(op.req, lost)
            if first and op.attempt > 1 and self._catch_up(live) and not op.reset:
                # Text of an earlier attempt the supervisor never heard of: the new
                # attempt voids it, or the log would hold two answers.
                op = replace(op, reset=True)
        refusal = self.fence.authorize(op.call_id, op.attempt)
        if refusal is not None:
            reason = self._refusal_reason(refusal, op)
            log.info("sink: authorize refused call=%s attempt=%d: %s", op.call_id, op.attempt, reason)
            return encode_refused(op.req, reason)
        self.flush_pending()  # the old attempt's pending run keeps its attempt number
        live.start_attempt(op.attempt, op.model)
        self.store.set_epoch(op.call_id, op.attempt)
        reset = None
        if op.reset:
            live.seq += 1
            reset = encode(reset_event(op.call_id, op.attempt, live.seq))
            self.store.add(op.call_id, live.seq, live.seq, op.attempt, "reset", reset)
        # Durable before the ack: after a restart no epoch may be handed out twice.
        self.commit()
        if reset is not None:
            self._send_event(live.subs, reset)
        log.debug("sink: authorized call=%s attempt=%d reset=%s", op.call_id, op.attempt, op.reset)
        return encode_ok(op.req, stats_to_wire(prev))

    def _refusal_reason(self, refusal: AuthorizeRefusal, op: Authorize | Rebind) -> str:
        view = self.fence.view(op.call_id)
        if refusal is AuthorizeRefusal.BAD_ATTEMPT:
            detail = f"attempt {op.attempt} must be at least 1"
        elif refusal is AuthorizeRefusal.CALL_FINISHED:
            detail = f"call {op.call_id} already has its done event"
        else:
            detail = f"attempt {op.attempt} is not above epoch {view.epoch if view else 0}"
        return f"{refusal.value}: {detail}"

    def _fence(self, op: Fence) -> bytes:
        self._rebind_settled(op.call_id)
        live = self._live(op.call_id)
        prev = live.stats(closed=True)
        view = self.fence.view(op.call_id)
        raised = view is None or op.attempt > view.epoch
        self.fence.fence(op.call_id, op.attempt)
        if raised:
            self.store.set_epoch(op.call_id, op.attempt)
            self.commit()
        log.debug("sink: fenced call=%s attempt=%d", op.call_id, op.attempt)
        return encode_ok(op.req, stats_to_wire(prev))

    def _catch_up(self, live: LiveCall) -> bool:
        """Cluster mode, for a call this sink process opens for the first time: the
        runs its log holds that the transcript does not (a predecessor that died
        between its appends and its commit) are stored first, so no seq is
        handed out twice. True if they hold deltas."""
        assert self.cluster is not None
        rows = self.cluster.missing(live.call_id, live.seq)
        if not rows:
            return False
        self.commit()
        self.store.add_replicated(rows)
        self.commit()
        live.seq = rows[-1][2]
        log.info("sink: call=%s: %d run(s) from its log stored here", live.call_id, len(rows))
        return any(row[4] == "delta" for row in rows)

    def _adopt(self, op: Adopt) -> bytes:
        """Cluster mode: a call taken over from a host that lost its lease
        (Adopt's docstring). Its events are stored as the log holds them; the
        fence stays closed until the supervisor authorizes `op.epoch`."""
        if self.cluster is None:
            return encode_refused(op.req, "not in cluster mode")
        if op.call_id in self.followed:  # another host's until now: this host's from here
            self.followed.pop(op.call_id)
            self.cluster.unfollow(op.call_id)
        rows = self.cluster.adopt(op.call_id, op.epoch)
        if isinstance(rows, str):
            return encode_refused(op.req, rows)
        # A call this host once ran or followed holds a prefix of its log here
        # (its rows were stored after the log had them): the rest is stored.
        known = self.store.call_row(op.call_id)
        rows = [r for r in rows if known is None or r[1] > known.last_seq]
        self.store.add_replicated(rows)
        self.store.set_epoch(op.call_id, op.epoch - 1)
        done = next((r for r in rows if r[4] == "done"), None)
        if done is not None:
            self.store.set_done(op.call_id, done[3], msgpack.unpackb(done[6])["status"],
                                done[1])
        self.commit()
        live = self._live(op.call_id)  # from the store: its epoch closed
        row = self.store.call_row(op.call_id)
        assert row is not None
        # What is stored, not what this sink counted (runs refused when the call
        # moved away counted and were never stored: `_follow`'s reason).
        live.seq = row.last_seq
        if row.status is not None:
            return encode_refused(op.req, f"call_finished: {row.status}")
        if row.last_seq:
            self._restore_content(live, op.epoch - 1)  # what was delivered, in its stats
        log.info("sink: call=%s adopted at epoch %d with %d stored event row(s)",
                 op.call_id, op.epoch, len(rows))
        return encode_ok(op.req, stats_to_wire(live.stats(closed=True)))

    def _follow(self, op: Follow) -> bytes:
        """Cluster mode: a call another host runs (Follow's docstring). Stored
        here as the log holds it; the fence stays closed (no attempt of this
        host may write it)."""
        if self.cluster is None:
            return encode_refused(op.req, "not in cluster mode")
        if op.call_id not in self.followed:
            if self.fence.view(op.call_id) is None and self.store.call_row(op.call_id) is None:
                self.store.set_epoch(op.call_id, 0)
                self.commit()
            live = self._live(op.call_id)  # closed: nothing of this host writes it (a
            view = self.fence.view(op.call_id)  # call that moved away was fenced here first)
            row = self.store.call_row(op.call_id)
            # What is stored, not what this sink once accepted: the runs the cluster
            # refused when the call moved away counted in `seq` but were never stored,
            # and the new owner's rows at those seqs must not be taken for repeats.
            live.seq = row.last_seq if row is not None else 0
            if view is None or not view.finished:
                self.followed[op.call_id] = 0
                self.apply_followed([(op.call_id, r) for r in self.cluster.follow(op.call_id)])
        view = self.fence.view(op.call_id)
        return encode_ok(op.req, {"done": view is not None and view.finished})

    def apply_followed(self, records: list[tuple[str, Any]]) -> None:
        """Store the followed calls' records (void ones skipped: §4.17, rule 6)
        and send their events to the calls' listeners; a done ends the following."""
        if not records or self.cluster is None:
            return
        self.commit()  # the replica's rows go after every row of this sink's own
        sent: list[tuple[LiveCall, bytes]] = []
        ended: list[tuple[str, dict[str, Any]]] = []
        for call_id, record in records:
            if call_id not in self.followed or record.epoch < self.followed[call_id]:
                continue
            if record.kind != EVENTS:
                self.followed[call_id] = record.epoch
                continue
            live = self._live(call_id)
            rows = [(call_id, seq, last, attempt, op, n, body)
                    for seq, last, attempt, op, n, body in record.body if seq > live.seq]
            self.store.add_replicated(rows)
            for row in rows:
                live.seq = row[2]
                sent += [(live, event) for event in split_events(row[6])]
                if row[4] == "done":
                    done = msgpack.unpackb(row[6])
                    self.store.set_done(call_id, row[3], done["status"], row[1])
                    ended.append((call_id, done))
        self.commit()
        for live, event in sent:
            self._send_event(live.subs, event)
        for call_id, done in ended:
            self.fence.finish(call_id)
            self.lives[call_id].subs = set()
            self._remember_finished(call_id)
            self.followed.pop(call_id, None)
            self.cluster.unfollow(call_id)
            self.peer.publish(encode_followed_done(call_id, done))

    # ---- rebinds (after a restart: docs/ARCHITECTURE.md §2.8) --------------------
    def _rebind(self, op: Rebind) -> bytes:
        """The running attempt `op.from_attempt` writes on as `op.attempt`: its
        answer so far is reloaded from the store (what was durable; the rest
        the worker sends again), and the new epoch's first seq follows it."""
        live = self._live(op.call_id)
        view = self.fence.view(op.call_id)
        if view is not None and (view.finished or op.attempt <= view.epoch):
            refusal = (AuthorizeRefusal.CALL_FINISHED if view.finished
                       else AuthorizeRefusal.STALE_EPOCH)
            return encode_refused(op.req, self._refusal_reason(refusal, op))
        if self.cluster is not None:
            first = not self.cluster.holds(op.call_id)
            lost = self.cluster.open(op.call_id, op.attempt)  # as for an authorize
            if lost is not None:
                return encode_refused(op.req, lost)
            if first:
                self._catch_up(live)
        self.flush_pending()
        self._restore_content(live, op.from_attempt, since=op.content_from)
        resume_after = live.content.deltas()
        self.fence.authorize(op.call_id, op.attempt, after_seq=resume_after)
        live.continue_attempt(op.attempt, op.content_from)
        self.store.set_epoch(op.call_id, op.attempt)
        self.commit()  # durable before the ack, as for authorize
        self.rebinds[op.call_id] = (op, resume_after)
        self._hello_over(op.call_id)  # its worker may have asked already
        self.rebound += 1
        log.info("sink: call=%s attempt %d writes on as attempt %d after seq %d",
                 op.call_id, op.from_attempt, op.attempt, resume_after)
        return encode_ok(op.req, stats_to_wire(live.stats(closed=False)))

    def handle_hello(self, hello: Hello, reply: Callable[[bytes], bool]) -> None:
        """A worker whose connection broke asks how to go on: as the attempt
        the supervisor rebound its run to (named by the run's token: several
        restarts may have rebound it while it never heard), or as itself if
        this sink still has it open, or not at all. Until the supervisor
        says, it waits (the next control op for the call answers it)."""
        if self._answer_rebound(hello, reply):
            return
        view = self.fence.view(hello.call_id)
        if view is None and self.store.call_row(hello.call_id) is not None:
            self._live(hello.call_id)  # known to the store only (a restart): load it
            view = self.fence.view(hello.call_id)
        if view is None or view.finished or hello.attempt > view.epoch:
            reply(rebind_frame(hello, 0, 0))  # never authorized here, or done
        elif view.open and view.epoch == hello.attempt:
            reply(rebind_frame(hello, hello.attempt, view.last_seq))  # only the connection broke
        else:
            self._hello_over(hello.call_id)
            self.hellos[hello.call_id] = (hello, reply)

    def _answer_rebound(self, hello: Hello, reply: Callable[[bytes], bool]) -> bool:
        """If the call's pending rebind is this hello's run's, tell it (once)."""
        pending = self.rebinds.get(hello.call_id)
        if pending is None or pending[0].token != hello.token:
            return False
        del self.rebinds[hello.call_id]
        reply(rebind_frame(hello, pending[0].attempt, pending[1]))
        return True

    def _hello_over(self, call_id: str) -> None:
        """A control op for the call came: a worker's waiting hello gets its
        answer (rebound to it, or over)."""
        waiting = self.hellos.pop(call_id, None)
        if waiting is not None and not self._answer_rebound(*waiting):
            waiting[1](rebind_frame(waiting[0], 0, 0))

    def _rebind_settled(self, call_id: str) -> None:
        """The supervisor decided the call otherwise (authorize, fence, finish):
        a rebind not yet asked for is void, and a waiting hello is told over."""
        self.rebinds.pop(call_id, None)
        self._hello_over(call_id)

    def _finish(self, op: Finish) -> bytes:
        self._rebind_settled(op.call_id)
        live = self._live(op.call_id)
        view = self.fence.view(op.call_id)
        if view is not None and view.finished:
            # Idempotent: a repeated finish gets the stored done event, nothing new.
            body = self.store.done_event(op.call_id)
            if body is None:
                return encode_refused(op.req, "call_finished: no done event stored")
            return encode_ok(op.req, msgpack.unpackb(body))
        epoch = view.epoch if view is not None else 0
        if self.cluster is not None and not self.cluster.holds(op.call_id):
            # A call that never ran here (its entry at epoch 0: cancelled while
            # queued) opens its log to write its done; one lost meanwhile cannot.
            lost = self.cluster.open(op.call_id, epoch)
            if lost is not None:
                self.fence.fence(op.call_id, epoch)
                return encode_refused(op.req, lost)
        response = live.content.build_response(op.meta)
        self.fence.finish(op.call_id)  # nothing more is accepted for this call
        self.flush_pending()
        live.seq += 1
        done = done_event(op.call_id, live.seq, op.status, response, op.error, op.attempts)
        body = encode(done)
        self.store.add(op.call_id, live.seq, live.seq, epoch, "done", body)
        self.store.set_done(op.call_id, epoch, op.status.value, live.seq)
        self.commit()  # committed before anyone can see it
        if self.cluster is not None and not self.cluster.holds(op.call_id):
            # The cluster refused it (another host took the call): the done went
            # with the run, never stored or sent; memory forgets it as the store did.
            self.fence.evict(op.call_id)
            self.fence.seed(op.call_id, epoch)
            row = self.store.call_row(op.call_id)
            live.seq = row.last_seq if row is not None else 0
            return encode_refused(op.req, "cluster_lost: another host owns the call now")
        self._send_event(live.subs, body)
        live.subs = set()  # the done is the last event
        live.content = Content()  # free the text; the store has it
        live.add = live.content.add
        self._remember_finished(op.call_id)
        log.debug("sink: done call=%s status=%s seq=%d", op.call_id, op.status.value, live.seq)
        return encode_ok(op.req, done)

    def _add_subscriber(self, op: AddSubscriber) -> bytes:
        """C_SUBSCRIBE: the listener gets the stored events after `from_seq` (a
        replay in slices, `serve_replays`), then, for a call that has not ended,
        follows it. It replaces the listener's earlier subscription to the call.
        The supervisor checked that the subscriber may see it."""
        listener = op.listener.encode()
        key = (listener, op.call_id)
        self.replays.pop(key, None)
        view = self.fence.view(op.call_id)
        if op.live and (view is None or not view.finished):
            live = self._live(op.call_id)  # a queued call is not known here yet
            live.subs.discard(listener)
            if op.from_seq == FROM_NOW or op.from_seq >= live.seq:
                live.subs.add(listener)
            else:
                self.replays[key] = Replay(op.from_seq, follow=True)
            return encode_ok(op.req, None)
        if op.from_seq == FROM_NOW:
            return encode_ok(op.req, None)  # ended: nothing comes from now on
        if op.from_seq == 0 and not self.store.events_after(op.call_id, 0, max_rows=1):
            # Pruned by retention before the journal's row: the call no longer exists.
            return encode_refused(op.req, f"unknown_call: no event of call {op.call_id} is stored")
        self.replays[key] = Replay(op.from_seq, follow=False)
        return encode_ok(op.req, None)

    def serve_replays(self) -> bool:
        """One slice of each replay that has room, for at most REPLAY_BUDGET_S in
        all, so no replay holds the loop; True if one could take more now.

        A replay that finds nothing more stored after its seq has caught up:
        once everything accepted for the call is stored (a commit first, if
        events wait), the listener joins the live feed, so it gets no gap and
        no repeat; for an ended call the replay just ends."""
        listeners, started = self.listeners, time.monotonic()
        more = False
        for key in list(self.replays):
            if time.monotonic() - started >= REPLAY_BUDGET_S:
                return True
            listener, call_id = key
            replay = self.replays.pop(key)  # put back at the end: round robin
            if listeners.room(listener) <= 0:
                self.replays[key] = replay
                continue
            events = self.store.events_after(call_id, replay.seq, max_rows=REPLAY_ROWS)
            if events:
                sent = listeners.replay(listener, events)
                if sent >= 0:  # else not connected: the replay ends, nothing follows
                    replay.seq += sent
                    self.replays[key] = replay
                    more = True
                continue
            live = self.lives.get(call_id)
            view = self.fence.view(call_id)
            if live is None or view is None or view.finished or not replay.follow:
                continue  # ended: all sent
            if live.seq > replay.seq:  # accepted, not stored yet
                self.commit()
                self.replays[key] = replay
                more = True
                continue
            live.subs.add(listener)
        return more

    def stats(self) -> dict[str, Any]:
        return {
            "accepted": self.accepted,
            "dropped": self.dropped,
            "dropped_by_verdict": {v.value: n for v, n in self.dropped_by.items()},
            "dropped_by_call": {c: sum(lv.drops.values())
                                for c, lv in self.lives.items() if lv.drops},
            "bad_frames": dict(self.bad_frames),
            "finals_accepted": self.finals_accepted,
            "finals_refused": self.finals_refused,
            "calls_in_memory": len(self.lives),
            "calls_open": sum(1 for c in self.fence if (v := self.fence.view(c)) and v.open),
            "db_rows": self.store.rows_written,
            "commits": self.store.commits,
            "calls_pruned": self.store.pruned,
            "pending_events": self.pending_events,
            "acks_unroutable": self.acks_unroutable,
            "attempts_rebound": self.rebound,
            "subscribed_calls": sum(1 for lv in self.lives.values() if lv.subs),
            "replays": len(self.replays),
            # The storage fault the store is waiting out (sink/store.py), if
            # any: SQLite's error and since when (wall clock); and how many
            # writes were tried again after one, since the start.
            "storage_fault": self.store.fault,
            "storage_fault_since": self.store.fault_since,
            "storage_retries": self.store.retries,
            "delta_latency": self.delta_latency.to_map(),
            **(self.cluster.stats() if self.cluster is not None else {}),
            **self.peer.stats(),
            **self.listeners.stats(),
        }

    # ---- worker finals -------------------------------------------------------------

    def handle_final(self, f: Final) -> bytes:
        """An attempt's final message; returns the encoded ack for the worker."""
        # Every delta up to last_seq is durable (and its event sent) before the
        # ack, and before E_ENDED / E_FINAL_REFUSED.
        self.commit()
        verdict = self.fence.close_on_final(f.call_id, f.attempt, f.last_seq)
        if verdict is FinalVerdict.ACCEPT:
            self.finals_accepted += 1
            stats = self.lives[f.call_id].stats(closed=True)
            self.peer.publish(encode_ended(f.call_id, f.attempt, stats, f.outcome))
            return final_ack_frame(f, True)
        if verdict is FinalVerdict.REPEATED:
            return final_ack_frame(f, True, "repeated")
        view = self.fence.view(f.call_id)
        if view is None:
            reason = f"{verdict.value}: call {f.call_id} is not known to the sink"
        else:
            reason = (f"{verdict.value}: current epoch {view.epoch} ({view.state.value}), "
                      f"last accepted seq {view.last_seq}, final says {f.last_seq}")
        self.finals_refused += 1
        log.warning("sink: final refused call=%s attempt=%d reason=%s",
                    f.call_id, f.attempt, reason)
        self.peer.publish(encode_final_refused(f.call_id, f.attempt, reason))
        return final_ack_frame(f, False, reason)

    # ---- refusals ------------------------------------------------------------------

    def drop(self, call_id: str, attempt: int, seq: int, verdict: Verdict) -> None:
        """Count a refused delta; the first of a (call, attempt) is logged at WARNING."""
        self.dropped += 1
        self.dropped_by[verdict] += 1
        live = self.lives.get(call_id)
        if live is not None:
            n = live.drops.get(attempt, 0) + 1
            live.drops[attempt] = n
            per_call = sum(live.drops.values())
            model = live.model
        else:
            key = (call_id, attempt)
            n = self.unknown_drops.get(key, 0) + 1
            if n > 1 or len(self.unknown_drops) < UNKNOWN_DROP_KEYS:
                self.unknown_drops[key] = n
            else:
                n = 2  # table full: a flood of forged ids is logged at DEBUG only
            per_call, model = n, None
        level = logging.WARNING if n == 1 else logging.DEBUG
        if fence_log.isEnabledFor(level):
            view = self.fence.view(call_id)
            expected = view.last_seq + 1 if view and verdict in _SEQ_VERDICTS else "-"
            fence_log.log(
                level,
                "fence: dropped delta %s call=%s attempt=%d current=%s seq=%d "
                "expected=%s verdict=%s dropped=%d dropped_call=%d model=%s",
                _DROP_WHY[verdict], call_id, attempt, view.epoch if view else "-", seq,
                expected, verdict.value, n, per_call, model or "-",
            )

    def bad_frame(self, where: str, reason: str) -> None:
        self.bad_frames[where] += 1
        now = time.monotonic()
        if now - self._bad_warned[where] >= WARN_EVERY_S:
            self._bad_warned[where] = now
            log.warning("sink: bad frame on sink.%s (%d so far): %s",
                        where, self.bad_frames[where], reason)
        else:
            log.debug("sink: bad frame on sink.%s: %s", where, reason)
