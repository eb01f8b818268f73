"""The operations that decide who writes a call: the supervisor's authorize,
fence and finish (C_AUTHORIZE, C_FENCE, C_FINISH) and a worker's final
(T_FINAL). sink/fence.py holds the pure rule they drive; each operation
here also does what the rule needs around it:

- authorize: a new epoch, durable before the ack (after a restart no epoch
  may be handed out twice), a fresh answer, and a `reset` event when the
  supervisor asks for one;
- fence: the attempt closed (an epoch above the current one is stored);
- finish: the call's `done` event, with the response assembled from the
  answer (sink/content.py), committed before anyone can see it; a repeated
  finish gets the stored done event;
- final: every delta up to its last seq is durable (and its event sent)
  before the ack, and before E_ENDED / E_FINAL_REFUSED to the supervisor.

Each reply reports the attempt's stats as they were before the operation.
Each operation answers through the `reply` it is given: at once, or in
cluster mode once the call's log allows (an authorize's epoch open, a
finish's done and a final's runs stored: sink/log_queue.py), while the
loop serves the other calls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgpack

from streamfence.protocol.codec import encode
from streamfence.protocol.failpoints import ARMED, failpoint
from streamfence.protocol.internal.control import (
    Authorize,
    Fence,
    Finish,
    Rebind,
    encode_ended,
    encode_final_refused,
    encode_ok,
    encode_refused,
    stats_to_wire,
)
from streamfence.protocol.internal.worker_wire import Final, final_ack_frame
from streamfence.protocol.messages import done_event, reset_event
from streamfence.sink.calls import Calls, LiveCall
from streamfence.sink.commits import Commits
from streamfence.sink.counters import Counters
from streamfence.sink.fence import AuthorizeRefusal, FenceTable, FinalVerdict
from streamfence.sink.peer import Publisher
from streamfence.sink.replica import Replica
from streamfence.sink.store import TranscriptStore

log = logging.getLogger("streamfence.sink")
Reply = Callable[[bytes], object]


def refusal_reason(fence: FenceTable, refusal: AuthorizeRefusal, op: Authorize | Rebind) -> str:
    """The R_REFUSED reason of an authorize (or a rebind) the fence refused."""
    view = fence.view(op.call_id)
    if refusal is AuthorizeRefusal.BAD_ATTEMPT:
        detail = f"attempt {op.attempt} must be at least 1"
    elif refusal is AuthorizeRefusal.CALL_FINISHED:
        detail = f"call {op.call_id} already has its done event"
    else:
        detail = f"attempt {op.attempt} is not above epoch {view.epoch if view else 0}"
    return f"{refusal.value}: {detail}"


class Fencing:
    """Carries out authorize, fence, finish and finals on the calls, the store
    and the commit schedule; owns no state of its own."""

    def __init__(self, store: TranscriptStore, calls: Calls, commits: Commits,
                 counters: Counters, peer: Publisher, replica: Replica | None) -> None:
        self._store = store
        self._calls = calls
        self._commits = commits
        self._counters = counters
        self._peer = peer
        self._replica = replica

    def authorize(self, op: Authorize, reply: Reply) -> None:
        calls = self._calls
        live = calls.live(op.call_id)
        view = calls.fence.view(op.call_id)
        if self._replica is not None and (view is None or op.attempt > view.epoch) \
                and not (view is not None and view.finished):
            # The log first (§4.17): the epoch opened there, without waiting.
            self._replica.authorize(op, live, lambda opened: self._authorized(op, opened, reply))
            return
        self._authorized(op, op, reply)

    def _authorized(self, asked: Authorize, opened: Authorize | str, reply: Reply) -> None:
        if isinstance(opened, str):  # another host owns the call: why
            log.info("sink: authorize refused call=%s attempt=%d: %s", asked.call_id,
                     asked.attempt, opened)
            reply(encode_refused(asked.req, opened))
            return
        op = opened
        calls = self._calls
        live = calls.live(op.call_id)
        prev = live.stats(closed=True)
        refusal = calls.fence.authorize(op.call_id, op.attempt)
        if refusal is not None:
            reason = refusal_reason(calls.fence, refusal, op)
            log.info("sink: authorize refused call=%s attempt=%d: %s", op.call_id, op.attempt, reason)
            reply(encode_refused(op.req, reason))
            return
        self._commits.flush_pending()  # the old attempt's pending run keeps its attempt number
        live.start_attempt(op.attempt, op.model)
        self._store.set_epoch(op.call_id, op.attempt)
        reset = None
        if op.reset:
            live.seq += 1
            reset = encode(reset_event(op.call_id, op.attempt, live.seq))
            self._store.add(op.call_id, live.seq, live.seq, op.attempt, "reset", reset)
        # Durable before the ack: after a restart no epoch may be handed out twice.
        self._commits.commit()
        if reset is not None:
            subs, event = live.subs, reset
            self._commits.after_stored(op.call_id, lambda: self._commits.send_event(subs, event))
        log.debug("sink: authorized call=%s attempt=%d reset=%s", op.call_id, op.attempt, op.reset)
        if ARMED:
            failpoint("sink.after_authorize")
        reply(encode_ok(op.req, stats_to_wire(prev)))

    def fence(self, op: Fence, reply: Reply) -> None:
        """Answered at once, in cluster mode too: it needs nothing of the cluster
        (what the fenced attempt sent before it is stored as its log allows)."""
        live = self._calls.live(op.call_id)
        prev = live.stats(closed=True)
        fence = self._calls.fence
        view = fence.view(op.call_id)
        raised = view is None or op.attempt > view.epoch
        fence.fence(op.call_id, op.attempt)
        if raised:
            self._store.set_epoch(op.call_id, op.attempt)
            self._commits.commit()
        log.debug("sink: fenced call=%s attempt=%d", op.call_id, op.attempt)
        reply(encode_ok(op.req, stats_to_wire(prev)))

    def finish(self, op: Finish, reply: Reply) -> None:
        calls, store = self._calls, self._store
        view = calls.fence.view(op.call_id)
        if view is not None and view.finished:
            # Idempotent: a repeated finish gets the stored done event, nothing new.
            body = store.done_event(op.call_id)
            if body is None:
                reply(encode_refused(op.req, "call_finished: no done event stored"))
            else:
                reply(encode_ok(op.req, [msgpack.unpackb(body), []]))  # counted the first time
            return
        epoch = view.epoch if view is not None else 0
        if self._replica is None:
            self._finish(op, epoch, reply)
            return

        def opened(lost: str | None) -> None:
            if lost is None:
                self._finish(op, epoch, reply)
            else:
                calls.fence.fence(op.call_id, epoch)
                reply(encode_refused(op.req, lost))
        self._replica.finish_open(op.call_id, epoch, opened)

    def _finish(self, op: Finish, epoch: int, reply: Reply) -> None:
        """The done event, stored (in cluster mode with its done mark, once its
        log holds it), then sent and answered."""
        calls, store = self._calls, self._store
        live = calls.live(op.call_id)
        response = live.content.build_response(op.meta)
        calls.fence.finish(op.call_id)  # nothing more is accepted for this call
        self._commits.flush_pending()
        live.seq += 1
        done = done_event(op.call_id, live.seq, op.status, response, op.error, op.attempts)
        body = encode(done)
        store.add(op.call_id, live.seq, live.seq, epoch, "done", body)
        if self._replica is None:  # cluster mode: sink/log_queue.py stores it with its row
            store.set_done(op.call_id, epoch, op.status.value, live.seq)
        self._commits.commit()  # committed before anyone can see it

        def stored() -> None:
            if self._replica is not None and self._replica.lost(op.call_id):
                reply(self._finish_lost(op, live, epoch))
                return
            self._commits.send_event(live.subs, body)
            if ARMED:
                failpoint("sink.after_done_sent")
            live.subs = set()  # the done is the last event
            live.forget_content()
            calls.remember_finished(op.call_id)
            log.debug("sink: done call=%s status=%s seq=%d", op.call_id, op.status.value,
                      live.seq)
            # With the deltas the fence refused of each attempt, as counted now
            # (a killed worker's last sends included: it was killed before).
            reply(encode_ok(op.req, [done, sorted(live.drops.items())]))
        self._commits.after_stored(op.call_id, stored)

    def _finish_lost(self, op: Finish, live: LiveCall, epoch: int) -> bytes:
        """The cluster refused the done (another host took the call): it went
        with the run, never stored or sent; memory forgets it as the store did."""
        fence = self._calls.fence
        fence.evict(op.call_id)
        fence.seed(op.call_id, epoch)
        row = self._store.call_row(op.call_id)
        live.seq = row.last_seq if row is not None else 0
        return encode_refused(op.req, "cluster_lost: another host owns the call now")

    def final(self, f: Final, ack: Reply) -> None:
        """An attempt's final message; `ack(the encoded ack)` for the worker.
        Every delta up to last_seq is durable (and its event sent) before the
        verdict and its ack, and before E_ENDED / E_FINAL_REFUSED: in cluster
        mode once the call's log holds them (the loop goes on meanwhile)."""
        self._commits.commit()

        def judged() -> None:
            ack(self._final_verdict(f))
        self._commits.after_stored(f.call_id, judged)

    def _final_verdict(self, f: Final) -> bytes:
        fence = self._calls.fence
        verdict = fence.close_on_final(f.call_id, f.attempt, f.last_seq)
        if verdict is FinalVerdict.ACCEPT:
            self._counters.finals_accepted += 1
            stats = self._calls.lives[f.call_id].stats(closed=True)
            self._peer.publish(encode_ended(f.call_id, f.attempt, stats, f.outcome))
            return final_ack_frame(f, True)
        if verdict is FinalVerdict.REPEATED:
            return final_ack_frame(f, True, "repeated")
        view = fence.view(f.call_id)
        if view is None:
            reason = f"{verdict.value}: call {f.call_id} is not known to the sink"
        else:
            reason = (f"{verdict.value}: current epoch {view.epoch} ({view.state.value}), "
                      f"last accepted seq {view.last_seq}, final says {f.last_seq}")
        self._counters.finals_refused += 1
        log.warning("sink: final refused call=%s attempt=%d reason=%s",
                    f.call_id, f.attempt, reason)
        self._peer.publish(encode_final_refused(f.call_id, f.attempt, reason))
        return final_ack_frame(f, False, reason)
