"""The calls the sink knows: per call its fence entry and its `LiveCall`.

`Calls` owns the fence table (sink/fence.py, the pure rule) and one
`LiveCall` per call in it: they are created and evicted together. A call
known only to the transcript (after a restart, or evicted) is loaded from
the store when first asked for (`live`); the unfinished ones are rebuilt at
start, closed until the supervisor authorizes a higher epoch. Finished calls
stay in memory, refusing everything, until `FINISHED_KEEP` newer ones have
finished (so late drops stay attributed).

A LiveCall's `pending` holds accepted events not yet handed to the store
(sink/commits.py writes them); `content` is its current attempt's answer
(sink/content.py), reloaded from the transcript by `restore_content`
(`transcript.answer_so_far`).
"""

from __future__ import annotations

import logging
from collections import deque

from streamfence.protocol.internal.control import AttemptStats
from streamfence.sink.content import Content
from streamfence.sink.event_pieces import delta_prefix
from streamfence.sink.fence import FenceTable
from streamfence.sink.store import TranscriptStore
from streamfence.sink.transcript import answer_so_far

log = logging.getLogger("streamfence.sink")

FINISHED_KEEP = 10_000  # finished calls kept in memory (late drops stay attributed)


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

    def start_attempt(self, attempt: int, model: str | None,
                      content: Content | None = None) -> None:
        """`attempt` writes the call from now on, on a fresh answer (or on
        `content`, its answer so far reloaded from the store)."""
        self.attempt = attempt
        self.content = Content() if content is None else content
        self.add = self.content.add
        self.prefix = delta_prefix(self.call_id, attempt)
        self.model = model

    def continue_attempt(self, attempt: int, shown_as: int) -> None:
        """`attempt` writes on the same answer (a rebind): the content stays,
        and its events keep the attempt number `shown_as` that began it (one
        provider attempt is one attempt to a subscriber, whatever its epochs)."""
        self.attempt = attempt
        self.prefix = delta_prefix(self.call_id, shown_as)

    def forget_content(self) -> None:
        """The call is done: free the text (the store has it)."""
        self.content = Content()
        self.add = self.content.add

    def stats(self, closed: bool) -> AttemptStats:
        c = self.content
        accepted = c.deltas()  # seqs are contiguous from 1
        return AttemptStats(self.attempt, accepted, self.drops.get(self.attempt, 0),
                            c.visible_chars(), c.tool_fragments(), accepted, closed)


class Calls:
    """Owns the fence table, the LiveCalls and the finished calls kept in memory."""

    def __init__(self, store: TranscriptStore) -> None:
        self.store = store
        self.fence = FenceTable()
        self.lives: dict[str, LiveCall] = {}
        self.finished: deque[str] = deque()
        for row in store.unfinished_calls():
            # Closed until the supervisor authorizes a higher epoch.
            self.fence.seed(row.call_id, row.max_epoch)
            live = self.lives[row.call_id] = LiveCall(row.call_id, row.last_seq)
            self.restore_content(live, row.max_epoch)
        if self.lives:
            log.info("sink: rebuilt %d unfinished calls from %s", len(self.lives), store.path)

    def live(self, call_id: str) -> LiveCall:
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
                    self.remember_finished(call_id)
        return live

    def remember_finished(self, call_id: str) -> None:
        self.finished.append(call_id)
        while len(self.finished) > FINISHED_KEEP:
            old = self.finished.popleft()
            self.fence.evict(old)
            self.lives.pop(old, None)

    def restore_content(self, live: LiveCall, epoch: int, since: int | None = None) -> None:
        """Reload the content of the answer attempt `epoch` writes from the
        store (after a restart), so its stats (visible_chars above all) tell
        the supervisor what was delivered. With `since`: a rebind, the answer
        that attempts `since`..`epoch` wrote together. Without: the newest
        attempt's (`transcript.answer_so_far`)."""
        if epoch < 1:
            return
        stored = self.store.events_after(live.call_id, 0)
        live.start_attempt(epoch, None, answer_so_far(stored, since, epoch))

    def open_count(self) -> int:
        """Calls whose current attempt may write."""
        fence = self.fence
        return sum(1 for c in fence if (v := fence.view(c)) and v.open)
