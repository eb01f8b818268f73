"""The histograms of the admin `status` (docs/PROTOCOL.md "status",
`histograms`; docs/METRICS.md): fixed buckets, their counts, the sum and the
count, as Prometheus keeps them, so the gateway's /metrics can show
durations of every call and not only of its own.

Each value is observed where its owner learns it, once per attempt, call or
group commit, never per delta:

- `attempt_first_chunk_seconds` (the issue's "time to first delta"): the
  worker's `first_chunk_ms` (outcome diag: from the attempt's start in the
  worker to the provider's first chunk), for each attempt whose final the
  sink accepted and that had a chunk. A fenced attempt reports none.
- `call_duration_seconds`: from a call's acceptance (AttemptDriver.release:
  it joins the queue) to the sink's storing of its done event. A call
  recovered at a start counts from its recovery.
- `delta_latency_seconds` is the sink's (sink/state.py `SinkState.commit`):
  per group commit that stored deltas, from the end of the loop turn that
  read its first delta (or the commit's start, when the commit came in that
  same turn) to the hand-off of its events to the subscribers' sockets after
  the commit: the sink's share of a delta's way, for the oldest delta of each
  commit.

Wire shape of each (msgpack/JSON friendly, no infinity): `{"le": [bounds],
"buckets": [cumulative count at each bound], "count": int, "sum": float}`;
the `+Inf` bucket is `count`.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the sink imports this module: it loads none of the supervisor's
    from streamfence.protocol.internal.outcome import AttemptOutcome
    from streamfence.supervisor.calls import FenceReason

FIRST_CHUNK_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
CALL_DURATION_BUCKETS = (0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
                         1800.0)
DELTA_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                         2.5, 10.0)

class Histogram:
    """Counts per bucket (the last one `+Inf`), and the sum of what was observed."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # a bucket's bound is inclusive
        self.sum += value

    def to_map(self) -> dict[str, Any]:
        cumulative, total = [], 0
        for n in self.counts[:-1]:
            total += n
            cumulative.append(total)
        return {"le": list(self.bounds), "buckets": cumulative,
                "count": total + self.counts[-1], "sum": self.sum}


def attempt_outcome(outcome: AttemptOutcome | None, fenced: FenceReason | None) -> str:
    """How an attempt ended, for `counters["attempts.<outcome>"]`: with its
    final accepted (which wins over a fence sent meanwhile), `ok` or `error`
    (the worker's failure); else the reason the supervisor fenced it
    (`stale`: a stale kill; calls.FenceReason)."""
    if outcome is not None:
        return "ok" if outcome.error is None else "error"
    return fenced.value if fenced is not None else "error"


class Histograms:
    """The supervisor's histograms, owned by the AttemptDriver, and the
    acceptance time of each live call (monotonic seconds)."""

    def __init__(self) -> None:
        self.first_chunk = Histogram(FIRST_CHUNK_BUCKETS)
        self.call_duration = Histogram(CALL_DURATION_BUCKETS)
        self._accepted: dict[str, float] = {}

    def accepted(self, call_id: str, now: float) -> None:
        self._accepted.setdefault(call_id, now)

    def attempt_ended(self, outcome: AttemptOutcome | None) -> None:
        if outcome is not None and outcome.diag.first_chunk_ms is not None:
            self.first_chunk.observe(outcome.diag.first_chunk_ms / 1000.0)

    def call_done(self, call_id: str, now: float) -> None:
        since = self._accepted.pop(call_id, None)
        if since is not None:
            self.call_duration.observe(max(0.0, now - since))

    def forget(self, call_id: str) -> None:
        self._accepted.pop(call_id, None)

    def to_map(self) -> dict[str, dict[str, Any]]:
        return {"attempt_first_chunk_seconds": self.first_chunk.to_map(),
                "call_duration_seconds": self.call_duration.to_map()}
