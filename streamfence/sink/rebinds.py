"""Rebinds: a running attempt goes on across a restart (docs/ARCHITECTURE.md §2.8).

After the sink (or the daemon) restarted, the supervisor rebinds each call
it still runs (C_REBIND): the attempt `from_attempt` writes on as a new
epoch, its answer so far reloaded from the store (what was durable; the rest
the worker sends again), the new epoch's first seq after it. A worker asks
how to go on (T_HELLO, named by its run's token) when its attempt begins
and when its connection broke, and is answered T_REBIND: as the attempt the
supervisor rebound it to, as itself if this sink has it open, or not at
all (0).

The two may come in either order. `Rebinds` owns, per call, the rebind the
supervisor made that its worker has not asked for yet, and the hello that
came before any rebind; the next control op for the call answers a waiting
hello. A rebind is void once the supervisor decides the call otherwise
(authorize, fence, finish: `settled`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from streamfence.protocol.failpoints import ARMED, failpoint
from streamfence.protocol.internal.control import Rebind, encode_ok, encode_refused, stats_to_wire
from streamfence.protocol.internal.worker_wire import Hello, rebind_frame
from streamfence.sink.calls import Calls
from streamfence.sink.commits import Commits
from streamfence.sink.fence import AuthorizeRefusal
from streamfence.sink.fencing import refusal_reason
from streamfence.sink.replica import Replica
from streamfence.sink.store import TranscriptStore

log = logging.getLogger("streamfence.sink")

Reply = Callable[[bytes], bool]  # sends a frame back to a worker: False if it cannot


class Rebinds:
    """Owns the rebinds not yet asked for, the hellos not yet answered, and
    the count of attempts rebound."""

    def __init__(self, store: TranscriptStore, calls: Calls, commits: Commits,
                 replica: Replica | None) -> None:
        self._store = store
        self._calls = calls
        self._commits = commits
        self._replica = replica
        self.pending: dict[str, tuple[Rebind, int]] = {}  # call -> (op, resume_after)
        self.hellos: dict[str, tuple[Hello, Reply]] = {}
        self.count = 0

    def rebind(self, op: Rebind, reply: Callable[[bytes], object]) -> None:
        """C_REBIND: the running attempt `op.from_attempt` writes on as `op.attempt`
        (in cluster mode once that epoch is open in the call's log)."""
        calls = self._calls
        live = calls.live(op.call_id)
        view = calls.fence.view(op.call_id)
        if view is not None and (view.finished or op.attempt <= view.epoch):
            refusal = (AuthorizeRefusal.CALL_FINISHED if view.finished
                       else AuthorizeRefusal.STALE_EPOCH)
            reply(encode_refused(op.req, refusal_reason(calls.fence, refusal, op)))
            return
        if self._replica is None:
            reply(self._rebound(op))
            return

        def opened(lost: str | None) -> None:  # the log first, as for an authorize
            reply(encode_refused(op.req, lost) if lost is not None else self._rebound(op))
        self._replica.rebind(op, live, opened)

    def _rebound(self, op: Rebind) -> bytes:
        calls = self._calls
        live = calls.live(op.call_id)
        self._commits.flush_pending()
        calls.restore_content(live, op.from_attempt, since=op.content_from)
        resume_after = live.content.deltas()
        calls.fence.authorize(op.call_id, op.attempt, after_seq=resume_after)
        live.continue_attempt(op.attempt, op.content_from)
        self._store.set_epoch(op.call_id, op.attempt)
        self._commits.commit()  # durable before the ack, as for authorize
        self.pending[op.call_id] = (op, resume_after)
        if ARMED:
            failpoint("sink.after_rebind")
        self._hello_over(op.call_id)  # its worker may have asked already
        self.count += 1
        log.info("sink: call=%s attempt %d writes on as attempt %d after seq %d",
                 op.call_id, op.from_attempt, op.attempt, resume_after)
        return encode_ok(op.req, stats_to_wire(live.stats(closed=False)))

    def hello(self, hello: Hello, reply: Reply) -> None:
        """T_HELLO: a worker whose attempt begins, or whose connection broke,
        asks how to go on (module docstring). Until the supervisor says, it waits (the next control op
        for the call answers it)."""
        if self._answer_rebound(hello, reply):
            return
        fence = self._calls.fence
        view = fence.view(hello.call_id)
        if view is None and self._store.call_row(hello.call_id) is not None:
            self._calls.live(hello.call_id)  # known to the store only (a restart): load it
            view = fence.view(hello.call_id)
        if view is None or view.finished or hello.attempt > view.epoch:
            reply(rebind_frame(hello, 0, 0))  # never authorized here, or done
        elif view.open and view.epoch == hello.attempt:
            reply(rebind_frame(hello, hello.attempt, view.last_seq))  # only the connection broke
        else:
            self._hello_over(hello.call_id)
            self.hellos[hello.call_id] = (hello, reply)

    def _answer_rebound(self, hello: Hello, reply: Reply) -> bool:
        """If the call's pending rebind is this hello's run's, tell it (once)."""
        pending = self.pending.get(hello.call_id)
        if pending is None or pending[0].token != hello.token:
            return False
        del self.pending[hello.call_id]
        reply(rebind_frame(hello, pending[0].attempt, pending[1]))
        return True

    def _hello_over(self, call_id: str) -> None:
        """A control op for the call came: a worker's waiting hello gets its
        answer (rebound to it, or over)."""
        waiting = self.hellos.pop(call_id, None)
        if waiting is not None and not self._answer_rebound(*waiting):
            waiting[1](rebind_frame(waiting[0], 0, 0))

    def settled(self, call_id: str) -> None:
        """The supervisor decided the call otherwise (authorize, fence, finish):
        a rebind not yet asked for is void, and a waiting hello is told over."""
        self.pending.pop(call_id, None)
        self._hello_over(call_id)
