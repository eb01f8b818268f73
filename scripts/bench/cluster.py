"""Section 10: cluster mode against single-host mode (issue 16, acceptance 3).

Two daemons on this machine against the same emulator: `single` (its
SQLite journal and transcript only) and `cluster` (the same, plus a `[cluster]`
table: one host on a real 3-node NATS JetStream cluster on loopback ports,
replication 3; docs/ARCHITECTURE.md §4.17). Each round, measure by measure,
the variants one after the other in rotated order (a pair close in time),
each once both daemons went quiet (`measure_rounds`, which
scripts/bench_ab_cluster.py runs on two source trees' hosts):

- TTFT: 1 stream (REPS calls one after the other) and a burst of 32, each a
  stream of 50 chunks at 50/s, read with the ZeroMQ client's wire
  (common.RawClient, as sections 7 and 9): request -> first text delta, p50;
- CPU per delta of those runs: the daemon's process tree, and in cluster
  mode the three nats-server processes beside it (shown apart and summed);
- deltas/s through the sink: 32 streams of 400 chunks sent as fast as the
  emulator writes them (`chunk_delay_s` 0): all deltas / the burst's wall
  time, from the first submit to the last done.

The cluster's extra cost is its round trips: `accepted` waits for the call's
record at the quorum, each attempt's compare-and-set and epoch record, and
each group commit waits for its appends (one per call, in flight together).
Reported, never asserted.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from scripts.bench.common import (
    CpuMeter,
    RawClient,
    Section,
    emulator,
    log,
    median,
    percentile,
    providers_for,
    raise_fd_limit,
    realistic_text,
    rotated,
    wait_idle,
    wait_quiet,
)
from scripts.bench.ttft import Call, zmq_streams
from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess
from streamfence.devtools.launcher import DaemonProcess
from streamfence.devtools.nats_cluster import NatsCluster, nats_cluster

VARIANTS = ("single", "cluster")
CHUNKS, DELAY_S = 50, 0.02
FAST_CHUNKS = 400
SPARE = 34


@contextlib.contextmanager
def host(root: Path, emu: EmulatorProcess, name: str, nats: NatsCluster | None,
         tree: Path | None = None) -> Iterator[DaemonProcess]:
    """A daemon in `root / name`, a host on `nats` if given; `tree`: the source
    tree whose package it runs (default: this one's)."""
    table = {"urls": nats.urls, "host": "bench", "replicas": 3} if nats else None
    proc = DaemonProcess(root / name, providers_for(emu, stale_timeout_s=60.0),
                         daemon={"log_level": "WARNING", "workers_spare": SPARE,
                                 "workers_max": SPARE + 16},
                         # -m in `tree` puts it first on sys.path; PYTHONPATH also
                         # reaches the spawned sink and zygote, whatever their cwd.
                         env={"PYTHONPATH": str(tree)} if tree else None, cwd=tree,
                         tables={"cluster": table} if table else None)
    try:
        proc.start(ready_timeout=180.0)
        yield proc
    finally:
        proc.cleanup()


def _calls(control: EmulatorClient, n: int, chunks: int, delay: float, text: str) -> list[Call]:
    calls = []
    for _ in range(n):
        key = f"cl-{uuid.uuid4().hex[:10]}"
        control.script(key, [{"fault": "ok", "chunks": chunks, "chunk_delay_s": delay,
                              "text": text}])
        calls.append(Call(f"emu-model#{key}", key))
    return calls


def _measure(proc: DaemonProcess, raw: RawClient, nats_pids: list[int],
             batches: list[list[Call]], text: str) -> dict[str, Any]:
    assert proc.proc is not None
    daemon_cpu, nats_cpu = CpuMeter([proc.proc.pid]), CpuMeter(nats_pids)
    daemon_cpu.start()
    nats_cpu.start()
    wall0 = time.perf_counter()
    for batch in batches:
        zmq_streams(raw, batch)
    wall = time.perf_counter() - wall0
    daemon_cpu.stop()
    nats_cpu.stop()
    calls = [c for b in batches for c in b]
    bad = [c for c in calls if c.error or c.text != text]
    if bad:
        raise RuntimeError(f"{len(bad)}/{len(calls)} calls failed; first: "
                           f"{bad[0].error or len(bad[0].text)}")
    deltas = sum(c.pieces for c in calls)
    return {"ttft": [c.first - c.t0 for c in calls], "daemon": daemon_cpu.total() / deltas,
            "nats": nats_cpu.total() / deltas, "rate": deltas / wall}


Results = dict[str, dict[str, list[dict[str, Any]]]]  # level -> variant -> one dict per round


def run(quick: bool, rounds: int) -> Section:
    sec = Section("cluster", "10 cluster mode")
    reps = 2 if quick else 5
    sec.params = {"rounds": rounds, "stream": f"{CHUNKS} chunks @ {1 / DELAY_S:.0f}/s",
                  "levels": f"1 (x {reps} one after the other), 32 (one burst); throughput: "
                            f"32 x {FAST_CHUNKS} chunks unpaced",
                  "NATS": "3 nodes, replication 3", "RLIMIT_NOFILE": raise_fd_limit()}
    with tempfile.TemporaryDirectory(prefix="sfbench-cl-") as tmp, emulator() as emu, \
            nats_cluster(Path(tmp) / "nats") as nats, \
            host(Path(tmp), emu, "single", None) as single, \
            host(Path(tmp), emu, "cluster", nats) as clustered:
        res = measure_rounds({"single": single, "cluster": clustered},
                             {"single": [], "cluster": node_pids(nats)}, emu.client(),
                             rounds, reps)
    _report(sec, res, reps)
    return sec


def node_pids(nats: NatsCluster) -> list[int]:
    return [nats.pid(i) for i in range(len(nats.nodes))]


def measure_rounds(procs: dict[str, DaemonProcess], nats_pids: dict[str, list[int]],
                   control: EmulatorClient, rounds: int, reps: int) -> Results:
    """The rounds of section 10 (module docstring) over `procs` (variant ->
    a started daemon), the variants in rotated order; `nats_pids`: the
    NATS nodes whose CPU counts beside each variant's daemon."""
    texts = {n: realistic_text(n) for n in (CHUNKS, FAST_CHUNKS)}
    # level -> (runs one after the other, calls at once, chunks, chunk delay)
    shapes = {"1": (reps, 1, CHUNKS, DELAY_S), "32": (1, 32, CHUNKS, DELAY_S),
              "rate": (1, 32, FAST_CHUNKS, 0.0)}
    res: Results = {level: {v: [] for v in procs} for level in shapes}
    raws = {v: RawClient(p) for v, p in procs.items()}
    try:
        for v, p in procs.items():
            wait_idle(p, SPARE)
            _measure(p, raws[v], [], [_calls(control, 4, 10, 0.0, realistic_text(10))],
                     realistic_text(10))  # unmeasured: connections, paths
        for r in range(rounds):
            for level, (runs, n, chunks, delay) in shapes.items():
                for v in rotated(list(procs), r):  # each level's pair close in time
                    wait_quiet(*procs.values())  # the other's spares warm up too
                    res[level][v].append(_measure(procs[v], raws[v], nats_pids[v], [
                        _calls(control, n, chunks, delay, texts[chunks]) for _ in range(runs)],
                        texts[chunks]))
            log(f"  cluster round {r + 1}/{rounds}: " + ", ".join(
                f"{v} 32-burst p50 {percentile(sorted(res['32'][v][-1]['ttft']), 50) * 1e3:.1f} ms, "
                f"{res['rate'][v][-1]['rate']:,.0f} deltas/s" for v in procs))
    finally:
        for raw in raws.values():
            raw.close()
    return res


# Issue 32's targets, cluster / single host (the same code in one run): at most
# these for TTFT and CPU per delta, at least this for deltas/s.
TTFT_TARGET, CPU_TARGET, RATE_TARGET = 1.3, 1.5, 0.8


def _report(sec: Section, res: Results, reps: int) -> None:
    for level, label in (("1", "1 stream"), ("32", "32 streams")):
        p50 = {v: percentile(sorted(t for r in res[level][v] for t in r["ttft"]), 50)
               for v in VARIANTS}
        cpu = {v: median([r["daemon"] + r["nats"] for r in res[level][v]]) for v in VARIANTS}
        daemon_only = median([r["daemon"] for r in res[level]["cluster"]])
        ttft_x, cpu_x = p50["cluster"] / p50["single"], cpu["cluster"] / cpu["single"]
        sec.row(f"{label}: TTFT p50 single / cluster",
                f"{p50['single'] * 1e3:.1f} / {p50['cluster'] * 1e3:.1f} ms "
                f"(x{ttft_x:.2f}, +{(p50['cluster'] - p50['single']) * 1e3:.1f} ms)",
                target=f"<= x{TTFT_TARGET}", met=ttft_x <= TTFT_TARGET)
        sec.row(f"{label}: CPU per delta single / cluster (daemon + NATS nodes)",
                f"{cpu['single'] * 1e6:,.0f} / {cpu['cluster'] * 1e6:,.0f} µs "
                f"(x{cpu_x:.2f}; the cluster's daemon alone {daemon_only * 1e6:,.0f} µs)",
                target=f"<= x{CPU_TARGET}" if level == "1" else "",
                met=cpu_x <= CPU_TARGET if level == "1" else None)
    rate = {v: median([r["rate"] for r in res["rate"][v]]) for v in VARIANTS}
    cpu_fast = {v: median([r["daemon"] + r["nats"] for r in res["rate"][v]]) for v in VARIANTS}
    rate_x = rate["cluster"] / rate["single"]
    sec.row("deltas/s through the sink, 32 unpaced streams, single / cluster",
            f"{rate['single']:,.0f} / {rate['cluster']:,.0f} (x{rate_x:.2f})",
            target=f">= x{RATE_TARGET}", met=rate_x >= RATE_TARGET)
    sec.row("CPU per delta there, single / cluster (daemon + NATS nodes)",
            f"{cpu_fast['single'] * 1e6:,.0f} / {cpu_fast['cluster'] * 1e6:,.0f} µs "
            f"(x{cpu_fast['cluster'] / cpu_fast['single']:.2f})")
    sec.note("- per-round 32-burst TTFT p50 (ms): " + "; ".join(
        f"{v} " + ", ".join(f"{percentile(sorted(r['ttft']), 50) * 1e3:.1f}"
                            for r in res["32"][v]) for v in VARIANTS)
        + "; per-round deltas/s: " + "; ".join(
        f"{v} " + ", ".join(f"{r['rate']:,.0f}" for r in res["rate"][v]) for v in VARIANTS)
        + f". 1 stream: {reps} calls one after the other per run.")
