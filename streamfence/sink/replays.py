"""Replays: a listener gets a call's stored events, then (maybe) its live feed.

C_SUBSCRIBE (`subscribe`; the supervisor checked that the subscriber may
see the call): the listener gets the stored events after `from_seq`, then,
for a call that has not ended, follows it (`LiveCall.subs`, where the hot
path looks). It replaces the listener's earlier subscription to the call.
It is charged to the identity the supervisor names (`op.owner`), within that
identity's caps on listeners and subscriptions (sink/shares.py; refused
`too_many_subscriptions`), and refused for a listener cut for a revoked key.

A replay is served in slices (`serve`, once per loop turn): at most
`REPLAY_ROWS` stored rows per replay per slice, only while its listener has
room (sink/subscribers.py's flow control: a replay waits for acks, never
cuts off), and at most `REPLAY_BUDGET_S` of the loop's time in all, round
robin: one slice per identity in each round, so an identity with
hundreds of replays gets as many turns as one with one, and a listener's
first frame never waits behind another identity's backlog. A replay that finds nothing more stored
after its seq has caught up: once everything accepted for the call is
stored (a commit first, if events wait), the listener joins the live feed,
so it gets no gap and no repeat; for an ended call the replay just ends.

A replay whose read fails (a damaged page of transcript.db, or a stored body
that is not the events the sink wrote) ends there: its listener is sent an
`error` event naming the call, the last seq it was sent and `storage_error`
(PROTOCOL §5), the failure is counted (`damaged`) and logged once per sink
with the file and what to do, and the sink goes on serving everything else.
"""

from __future__ import annotations

import logging
import sqlite3
import time

import msgpack

from streamfence.protocol.codec import encode
from streamfence.protocol.errors import ErrorCode
from streamfence.protocol.internal.control import FROM_NOW, AddSubscriber, encode_ok, encode_refused
from streamfence.protocol.messages import error_msg
from streamfence.sink.calls import Calls
from streamfence.sink.commits import Commits
from streamfence.sink.listeners import Listeners
from streamfence.sink.store import TranscriptStore

REPLAY_BUDGET_S = 0.002  # time spent per loop turn, at most ...
REPLAY_ROWS = 8  # ... in slices of this many stored rows (each up to COMMIT_EVERY events)
# What a read of damaged storage raises: SQLite's error, or msgpack's on a
# body that is not what was written (an overwritten overflow page).
READ_ERRORS = (sqlite3.DatabaseError, msgpack.UnpackException, ValueError)

log = logging.getLogger("streamfence.sink")


class Replay:
    """A listener's replay of one call: `seq` is the last seq sent; `follow`:
    join the live feed once caught up, if the call has not ended; `owner`:
    the identity it is charged to (its turn in `Replays.serve`)."""

    __slots__ = ("follow", "owner", "seq")

    def __init__(self, seq: int, follow: bool, owner: str) -> None:
        self.seq = seq
        self.follow = follow
        self.owner = owner


class Replays:
    """Owns the replays in progress: (listener, call_id) -> its Replay."""

    def __init__(self, store: TranscriptStore, calls: Calls, commits: Commits,
                 listeners: Listeners) -> None:
        self._store = store
        self._calls = calls
        self._commits = commits
        self._listeners = listeners
        self.active: dict[tuple[bytes, str], Replay] = {}
        self.damaged = 0  # replays ended by a read that failed (module docstring)

    def subscribe(self, op: AddSubscriber) -> bytes:
        """C_SUBSCRIBE (module docstring)."""
        listener = op.listener.encode()
        key = (listener, op.call_id)
        refused = self._listeners.subscribe(listener, op.call_id, op.owner, self.following)
        if refused is not None:
            return encode_refused(op.req, refused)
        self.active.pop(key, None)
        view = self._calls.fence.view(op.call_id)
        if op.live and (view is None or not view.finished):
            live = self._calls.live(op.call_id)  # a queued call is not known here yet
            live.subs.discard(listener)
            if op.from_seq == FROM_NOW or op.from_seq >= live.seq:
                live.subs.add(listener)
            else:
                self.active[key] = Replay(op.from_seq, True, op.owner.name)
            return encode_ok(op.req, None)
        if op.from_seq == FROM_NOW:
            return encode_ok(op.req, None)  # ended: nothing comes from now on
        try:
            gone = op.from_seq == 0 and not self._store.events_after(op.call_id, 0, max_rows=1)
        except READ_ERRORS:
            gone = False  # the replay meets it again and says so (`_failed`)
        if gone:
            # Pruned by retention before the journal's row: the call no longer exists.
            return encode_refused(op.req, f"unknown_call: no event of call {op.call_id} is stored")
        self.active[key] = Replay(op.from_seq, False, op.owner.name)
        return encode_ok(op.req, None)

    def following(self, listener: bytes, call_id: str) -> bool:
        """Does `listener` still follow `call_id` (a replay, or the live feed)?"""
        if (listener, call_id) in self.active:
            return True
        live = self._calls.lives.get(call_id)
        return live is not None and listener in live.subs

    def drop(self, listeners: list[bytes]) -> None:
        """Every subscription of these listeners ends now (their key was
        revoked: sink/subscribers.py `tick`)."""
        for listener in listeners:
            for call_id in self._listeners.unsubscribe_all(listener):
                self.active.pop((listener, call_id), None)
                live = self._calls.lives.get(call_id)
                if live is not None:
                    live.subs.discard(listener)

    def serve(self) -> bool:
        """Slices of the replays that have room, one per identity per round, for
        at most REPLAY_BUDGET_S in all; True if one could take more now
        (module docstring)."""
        started = time.monotonic()
        more = False
        while True:
            served = self._round(started)
            if served is None:
                return True  # out of time
            more = more or served
            if not served:
                return more

    def _round(self, started: float) -> bool | None:
        """One slice for each identity whose replays have room (its first one
        in order that has; served replays go to the end): True if one was
        served, None if the budget ran out."""
        listeners, active = self._listeners, self.active
        turned: set[str] = set()  # the identities served this round
        served = False
        for key in list(active):
            replay = active.get(key)
            if replay is None or replay.owner in turned:
                continue
            if time.monotonic() - started >= REPLAY_BUDGET_S:
                return None
            listener, call_id = key
            if listeners.room(listener) <= 0:
                continue
            turned.add(replay.owner)
            del active[key]  # put back at the end: round robin
            try:
                events = self._store.events_after(call_id, replay.seq, max_rows=REPLAY_ROWS)
            except READ_ERRORS as exc:
                self._failed(listener, call_id, replay.seq, exc)
                continue
            if events:
                sent = listeners.replay(listener, events)
                if sent >= 0:  # else not connected: the replay ends, nothing follows
                    replay.seq += sent
                    active[key] = replay
                    served = served or sent > 0
                continue
            more = self._caught_up(key, replay)
            if more is not None:
                active[key] = replay
                served = served or more
        return served

    def _failed(self, listener: bytes, call_id: str, seq: int, exc: Exception) -> None:
        """The replay's read failed: it ends with an `error` event to its listener."""
        self.damaged += 1
        what = f"{type(exc).__name__}: {exc}"
        if self.damaged == 1:
            log.error("sink: %s is damaged: replaying call %s after seq %d failed (%s); "
                      "the listener is sent storage_error, other calls are served; stop the "
                      "daemon, run `streamfence check`, then restore the file from a backup",
                      self._store.path, call_id, seq, what)
        self._listeners.replay(listener, [encode(dict(
            error_msg(None, ErrorCode.STORAGE_ERROR,
                      f"the stored events of call {call_id} after seq {seq} cannot be read: "
                      f"the daemon's transcript is damaged ({what})"),
            call_id=call_id, seq=seq))])

    def _caught_up(self, key: tuple[bytes, str], replay: Replay) -> bool | None:
        """Nothing more is stored after the replay's seq: the listener joins the
        live feed, or the replay ends (None). It goes on if events were accepted
        and not stored yet: they are committed now (True), or, in cluster mode,
        wait for their call's log (False: served again once stored)."""
        listener, call_id = key
        live = self._calls.lives.get(call_id)
        view = self._calls.fence.view(call_id)
        if live is None or view is None:
            return None
        if live.seq > replay.seq and (replay.follow or view.finished):  # not stored yet
            self._commits.commit()
            return not self._commits.waits(call_id)
        if view.finished or not replay.follow:
            return None  # ended: all sent
        live.subs.add(listener)
        return None
