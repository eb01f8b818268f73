"""What workers sent the sink, counted: deltas accepted and refused, bad
frames, finals accepted and refused, acks that found no worker.

Refusals are logged sparsely: the first refused delta of a (call, attempt)
at WARNING, one line with one grep-able prefix ("fence: dropped delta"),
the rest at DEBUG; bad frames at most one WARNING per socket per
`WARN_EVERY_S`. A refused delta of a known call is counted on its LiveCall
(`drops`, per attempt: the attempt's stats carry it); of an unknown call in
a bounded table, so a flood of forged ids costs no memory.
"""

from __future__ import annotations

import logging
import time

from streamfence.sink.calls import Calls
from streamfence.sink.fence import Verdict

log = logging.getLogger("streamfence.sink")
fence_log = logging.getLogger("streamfence.sink.fence")

UNKNOWN_DROP_KEYS = 4096  # (call, attempt) pairs of unknown calls tracked for logging
WARN_EVERY_S = 10.0  # bad frames: at most one WARNING per socket per interval

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


class Counters:
    """Owns the sink's input counters. The hot path (sink/intake.py) adds its
    accepted deltas once per batch, and calls `drop` per refused delta."""

    def __init__(self, calls: Calls) -> None:
        self._calls = calls
        self.accepted = 0
        self.dropped = 0
        self.dropped_by: dict[Verdict, int] = {v: 0 for v in Verdict if v is not Verdict.ACCEPT}
        self.unknown_drops: dict[tuple[str, int], int] = {}
        self.bad_frames = {"in": 0, "ctl": 0}
        self._bad_warned = {"in": -WARN_EVERY_S, "ctl": -WARN_EVERY_S}
        self.finals_accepted = 0
        self.finals_refused = 0
        self.acks_unroutable = 0  # finals whose worker left before its ack

    def drop(self, call_id: str, attempt: int, seq: int, verdict: Verdict) -> None:
        """Count a refused delta; the first of a (call, attempt) is logged at WARNING."""
        self.dropped += 1
        self.dropped_by[verdict] += 1
        live = self._calls.lives.get(call_id)
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
            view = self._calls.fence.view(call_id)
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

    def dropped_by_call(self) -> dict[str, int]:
        return {c: sum(lv.drops.values()) for c, lv in self._calls.lives.items() if lv.drops}
