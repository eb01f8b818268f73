"""The histograms of the admin `status` (docs/PROTOCOL.md "status",
`histograms`; docs/METRICS.md): fixed buckets, their counts, the sum and the
count, as Prometheus keeps them, so the gateway's /metrics can show
durations of every call and not only of its own.

Each value is observed where its owner learns it, once per attempt, call or
group commit, never per delta:

- `attempt_first_chunk_seconds` (the time to the first delta): the
  worker's `first_chunk_ms` (outcome diag: from the attempt's start in the
  worker to the provider's first chunk), for each attempt whose final the
  sink accepted and that had a chunk. A fenced attempt reports none.
- `call_duration_seconds`: from a call's acceptance (AttemptDriver.release:
  it joins the queue) to the sink's storing of its done event. A call
  recovered at a start counts from its recovery.
- `delta_latency_seconds` is the sink's (sink/commits.py `Commits.commit`):
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
from typing import Any

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
