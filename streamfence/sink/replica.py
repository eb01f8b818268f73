"""Cluster mode at the sink (docs/ARCHITECTURE.md §4.17): the transcript as
a replica of the calls' logs on JetStream (sink/cluster_log.py).

`Replica` owns the ClusterLog, the LogQueue (what waits for the calls'
logs: every commit's rows go there first, sink/log_queue.py) and the calls
this host follows (another host runs them). Its steps, each called where
the sink's operations need them:

- `lost`: the runs of a call another host took were refused (never stored,
  never sent): its attempt is fenced and the supervisor told (E_LOST);
- `authorize` / `rebind` / `finish_open`: an attempt's epoch is open in
  the call's log before the sink acks it (the sink, the only writer of the
  log, opens it; an authorize's and a finish's without waiting); the runs
  the log holds that the transcript does not (a predecessor that died
  between its appends and its commit) are stored first, so no seq is
  handed out twice;
- `adopt` (C_ADOPT): a call taken over from a host that lost its lease;
- `follow` (C_FOLLOW) and `apply_followed`: a call another host runs, stored
  here as its log holds it, its events sent to this host's listeners.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import msgpack

from streamfence.cluster.records import EVENTS
from streamfence.protocol.internal.control import (
    Adopt,
    Authorize,
    Follow,
    Rebind,
    encode_followed_done,
    encode_lost,
    encode_ok,
    encode_refused,
    stats_to_wire,
)
from streamfence.sink.calls import Calls, LiveCall
from streamfence.sink.commits import Commits
from streamfence.sink.peer import Publisher
from streamfence.sink.store import TranscriptStore
from streamfence.sink.transcript import split_events

if TYPE_CHECKING:  # imported by the sink only in cluster mode (it brings nats)
    from streamfence.cluster.records import Record
    from streamfence.sink.cluster_log import ClusterLog, Row

log = logging.getLogger("streamfence.sink")


class Replica:
    """Owns the ClusterLog and `followed`: the calls another host runs that
    this host follows -> the epoch of the record read last."""

    def __init__(self, cluster: ClusterLog, store: TranscriptStore, calls: Calls,
                 commits: Commits, peer: Publisher) -> None:
        self.cluster = cluster
        self._store = store
        self._calls = calls
        self._commits = commits
        self._peer = peer
        self.followed: dict[str, int] = {}
        from streamfence.sink.log_queue import LogQueue  # with cluster_log: cluster mode only

        self.queue = LogQueue(cluster, store, calls, commits, self.moved)
        commits.replicate = self.queue.take
        commits.after_stored = self.queue.after_stored
        commits.waits = self.queue.waits

    def moved(self, call_id: str) -> None:
        """The cluster refused the call's runs: another host owns it now (they
        were never stored or sent); its attempt is fenced, the supervisor told."""
        fence = self._calls.fence
        view = fence.view(call_id)
        epoch = view.epoch if view is not None else 0
        if view is not None and view.open:
            fence.fence(call_id, epoch)
        self._peer.publish(encode_lost(call_id, epoch, "another host owns the call now"))

    def _store_missing(self, live: LiveCall, rows: list[Row]) -> bool:
        """For a call this sink process opens for the first time: the runs its
        log holds that the transcript does not are stored first. True if they
        hold deltas."""
        rows = [row for row in rows if row[1] > live.seq]
        if not rows:
            return False
        self._commits.commit()
        self._store.add_replicated(rows)
        self._commits.commit()
        live.seq = rows[-1][2]
        log.info("sink: call=%s: %d run(s) from its log stored here", live.call_id, len(rows))
        return any(row[4] == "delta" for row in rows)

    def authorize(self, op: Authorize, live: LiveCall,
                  then: Callable[[Authorize | str], None]) -> None:
        """The log first: `op.attempt`'s epoch opened in the call's log, once
        every run of the call before it is stored, without waiting; then
        `then(the op to carry out, or why not)`.

        A call's first attempt (this host accepted it, and took it from epoch 0
        a moment ago) is carried out at once, its epoch's open in flight: its
        runs, their events and its final wait for the open, and a refused open
        fences the attempt (E_LOST), as a refused append does. So a call's
        first token does not wait for the open's round trips; a later
        attempt (a retry, a takeover: where another host may be taking the
        call) starts only once its epoch is open, so that no provider request
        is made for a call whose log is another host's."""
        read = not self.cluster.holds(op.call_id) and op.attempt > 1
        if op.attempt == 1 and not self.queue.waits(op.call_id):
            self.queue.open(op.call_id, op.attempt, False,
                            lambda rows: self.moved(op.call_id) if isinstance(rows, str) else None)
            then(op)
            return

        def opened(rows: list[Row] | str) -> None:
            if isinstance(rows, str):
                then(rows)
            elif read and self._store_missing(live, rows) and not op.reset:
                # Text of an earlier attempt the supervisor never heard of: the new
                # attempt voids it, or the log would hold two answers.
                then(replace(op, reset=True))
            else:
                then(op)
        self.queue.open(op.call_id, op.attempt, read, opened)

    def rebind(self, op: Rebind, live: LiveCall, then: Callable[[str | None], None]) -> None:
        """The rebound epoch opened in the call's log, as for an authorize,
        without waiting: `then(None)`, or `then(why not)`."""
        read = not self.cluster.holds(op.call_id)

        def opened(rows: list[Row] | str) -> None:
            if isinstance(rows, str):
                then(rows)
                return
            if read:
                self._store_missing(live, rows)
            then(None)
        self.queue.open(op.call_id, op.attempt, read, opened)

    def finish_open(self, call_id: str, epoch: int, then: Callable[[str | None], None]
                    ) -> None:
        """A call that never ran here (its entry at epoch 0: cancelled while
        queued) opens its log to write its done, without waiting: `then(None)`;
        one lost meanwhile cannot: `then(why not)`."""
        if self.cluster.holds(call_id):
            then(None)
            return
        self.queue.open(call_id, epoch, False,
                        lambda rows: then(rows if isinstance(rows, str) else None))

    def lost(self, call_id: str) -> bool:
        """The cluster refused the call's runs (another host took it)."""
        return not self.cluster.holds(call_id)

    def adopt(self, op: Adopt, reply: Callable[[bytes], object]) -> None:
        """A call taken over from a host that lost its lease (Adopt's
        docstring): its epoch opened in its log (the old owner can write no
        more), without waiting; then its events are stored as the log holds
        them; the fence stays closed until the supervisor authorizes `op.epoch`."""
        if op.call_id in self.followed:  # another host's until now: this host's from here
            self.followed.pop(op.call_id)
            self.cluster.unfollow(op.call_id)
        self.queue.open(op.call_id, op.epoch, True, lambda rows: reply(self._adopted(op, rows)))

    def _adopted(self, op: Adopt, rows: list[Row] | str) -> bytes:
        if isinstance(rows, str):
            return encode_refused(op.req, rows)
        store = self._store
        # A call this host once ran or followed holds a prefix of its log here
        # (its rows were stored after the log had them): the rest is stored.
        known = store.call_row(op.call_id)
        rows = [r for r in rows if known is None or r[1] > known.last_seq]
        store.add_replicated(rows)
        store.set_epoch(op.call_id, op.epoch - 1)
        done = next((r for r in rows if r[4] == "done"), None)
        if done is not None:
            store.set_done(op.call_id, done[3], msgpack.unpackb(done[6])["status"], done[1])
        self._commits.commit()
        live = self._calls.live(op.call_id)  # from the store: its epoch closed
        row = store.call_row(op.call_id)
        assert row is not None
        # What is stored, not what this sink counted (runs refused when the call
        # moved away counted and were never stored: `follow`'s reason).
        live.seq = row.last_seq
        if row.status is not None:
            return encode_refused(op.req, f"call_finished: {row.status}")
        if row.last_seq:
            self._calls.restore_content(live, op.epoch - 1)  # what was delivered, in its stats
        log.info("sink: call=%s adopted at epoch %d with %d stored event row(s)",
                 op.call_id, op.epoch, len(rows))
        return encode_ok(op.req, stats_to_wire(live.stats(closed=True)))

    def follow(self, op: Follow, reply: Callable[[bytes], object]) -> None:
        """A call another host runs (Follow's docstring). Stored here as the
        log holds it, read without waiting; the fence stays closed (no attempt
        of this host may write it)."""
        calls, store = self._calls, self._store

        def answer() -> None:
            view = calls.fence.view(op.call_id)
            reply(encode_ok(op.req, {"done": view is not None and view.finished}))
        if op.call_id in self.followed:
            answer()
            return
        if calls.fence.view(op.call_id) is None and store.call_row(op.call_id) is None:
            store.set_epoch(op.call_id, 0)
            self._commits.commit()
        live = calls.live(op.call_id)  # closed: nothing of this host writes it (a
        view = calls.fence.view(op.call_id)  # call that moved away was fenced here first)
        row = store.call_row(op.call_id)
        # What is stored, not what this sink once accepted: the runs the cluster
        # refused when the call moved away counted in `seq` but were never stored,
        # and the new owner's rows at those seqs must not be taken for repeats.
        live.seq = row.last_seq if row is not None else 0
        if view is not None and view.finished:
            answer()
            return
        self.followed[op.call_id] = 0

        def read(records: list[Record] | BaseException) -> None:
            if isinstance(records, BaseException):
                self.followed.pop(op.call_id, None)
                reply(encode_refused(op.req, f"cluster_unavailable: {type(records).__name__}: "
                                             f"{records}"))
                return
            self.apply_followed([(op.call_id, r) for r in records])
            answer()
        self.queue.ask(op.call_id, lambda answered: self.cluster.follow_soon(op.call_id, answered),
                       read, again=False)

    def wake_fd(self) -> int:
        """Readable when followed calls' records came (for the sink's poller)."""
        return self.cluster.bridge.fd

    def on_wake(self) -> None:
        self.cluster.bridge.run_done()
        self.queue.settle()
        self.apply_followed(self.cluster.incoming())

    def apply_followed(self, records: list[tuple[str, Any]]) -> None:
        """Store the followed calls' records (void ones skipped: §4.17, rule 6)
        and send their events to the calls' listeners; a done ends the following."""
        if not records:
            return
        commits, store = self._commits, self._store
        commits.commit()  # the replica's rows go after every row of this sink's own
        sent: list[tuple[LiveCall, bytes]] = []
        ended: list[tuple[str, dict[str, Any]]] = []
        for call_id, record in records:
            if call_id not in self.followed or record.epoch < self.followed[call_id]:
                continue
            if record.kind != EVENTS:
                self.followed[call_id] = record.epoch
                continue
            live = self._calls.live(call_id)
            rows = [(call_id, seq, last, attempt, op, n, body)
                    for seq, last, attempt, op, n, body in record.body if seq > live.seq]
            store.add_replicated(rows)
            for row in rows:
                live.seq = row[2]
                sent += [(live, event) for event in split_events(row[6])]
                if row[4] == "done":
                    done = msgpack.unpackb(row[6])
                    store.set_done(call_id, row[3], done["status"], row[1])
                    ended.append((call_id, done))
        commits.commit()
        for live, event in sent:
            commits.send_event(live.subs, event)
        for call_id, done in ended:
            self._end_following(call_id, done)

    def _end_following(self, call_id: str, done: dict[str, Any]) -> None:
        self._calls.fence.finish(call_id)
        self._calls.lives[call_id].subs = set()
        self._calls.remember_finished(call_id)
        self.followed.pop(call_id, None)
        self.cluster.unfollow(call_id)
        self._peer.publish(encode_followed_done(call_id, done))

    def stats(self) -> dict[str, int]:
        return {**self.cluster.stats(), **self.queue.stats()}

    def close(self) -> None:
        self.cluster.close()
