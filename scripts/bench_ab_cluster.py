"""Section 10's cluster-mode figures for two source trees of streamfence,
side by side in one run (as scripts/bench_ab.py does for single-host mode).

    python -m scripts.bench_ab_cluster TREE_A TREE_B [--rounds N] [--quick]

Each tree runs a cluster-mode host: its own state directory, its own `serve`
started in that tree (so it imports that tree's package), on its own 3-node
NATS cluster on loopback (replication 3); both on one emulator. Not one NATS
cluster for both: two hosts on one cluster are peers of one streamfence
cluster (each lists the other's owner entries and may take over its calls),
two code versions could disagree on the streams' layout, and each tree's
NATS CPU would include the other's background.

The rounds are section 10's (scripts/bench/cluster.py `measure_rounds`, the
trees in rotated order): 1 stream (REPS calls one after the other) and a
burst of 32, 50 chunks at 50/s each: TTFT p50 and CPU per delta (the
daemon's process tree + its three NATS nodes); 32 streams of 400 chunks
unpaced: deltas/s and CPU per delta. Printed: each tree's median over the
rounds and B/A as the median of the per-round ratios with their spread (min
.. max), so the machine's noise shows beside it; the load average before
and after. Reported, never asserted.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from scripts.bench.cluster import Results, host, measure_rounds, node_pids
from scripts.bench.common import emulator, log, median, percentile, raise_fd_limit, ratio_spread
from streamfence.devtools.nats_cluster import nats_cluster

TREES = ("A", "B")

# (what, section 10's level, one round's value): lower is better but for deltas/s.
MEASURES: tuple[tuple[str, str, Callable[[dict[str, Any]], float]], ...] = (
    ("1 stream: TTFT p50 (ms)", "1", lambda r: percentile(sorted(r["ttft"]), 50) * 1e3),
    ("1 stream: CPU/delta, daemon + NATS (µs)", "1", lambda r: (r["daemon"] + r["nats"]) * 1e6),
    ("32 streams: TTFT p50 (ms)", "32", lambda r: percentile(sorted(r["ttft"]), 50) * 1e3),
    ("32 streams: CPU/delta, daemon + NATS (µs)", "32",
     lambda r: (r["daemon"] + r["nats"]) * 1e6),
    ("32 unpaced: deltas/s (higher is better)", "rate", lambda r: r["rate"]),
    ("32 unpaced: CPU/delta, daemon + NATS (µs)", "rate",
     lambda r: (r["daemon"] + r["nats"]) * 1e6),
)


def table(res: Results) -> list[str]:
    """The B/A table of `measure_rounds`' results for trees A and B."""
    lines = ["| measure | A (median) | B (median) | B/A median | B/A per round (min .. max) |",
             "|---|---:|---:|---:|---:|"]
    for what, level, value in MEASURES:
        a, b = ([value(r) for r in res[level][t]] for t in TREES)
        mid, low, high = ratio_spread(a, b)
        lines.append(f"| {what} | {median(a):,.1f} | {median(b):,.1f} | {mid:.3f} | "
                     f"{low:.3f} .. {high:.3f} |")
    return lines


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trees", nargs=2, type=Path, help="TREE_A TREE_B")
    p.add_argument("--quick", action="store_true", help="8 rounds, 3 calls at 1 stream")
    p.add_argument("--rounds", type=int, default=None, help="default 16 (8 with --quick)")
    args = p.parse_args()
    rounds = args.rounds or (8 if args.quick else 16)
    reps = 3 if args.quick else 5
    raise_fd_limit()
    load_before = _load()
    with tempfile.TemporaryDirectory(prefix="sfab-cl-") as tmp, emulator() as emu, \
            ExitStack() as stack:
        procs, pids = {}, {}
        for name, tree in zip(TREES, args.trees, strict=True):
            log(f"starting {name} = {tree}: 3 NATS nodes and a cluster-mode host")
            nats = stack.enter_context(nats_cluster(Path(tmp) / f"nats-{name}"))
            procs[name] = stack.enter_context(host(Path(tmp), emu, name, nats, tree.resolve()))
            pids[name] = node_pids(nats)
        res = measure_rounds(procs, pids, emu.client(), rounds, reps)
    print(f"\nA = {args.trees[0]}\nB = {args.trees[1]}\n{rounds} rounds, 1 stream: {reps} "
          f"calls per round; load average (1, 5, 15 min) before {load_before}, "
          f"after {_load()}\n")
    print("\n".join(table(res)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
