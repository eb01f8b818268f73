"""Section 2: sink throughput, beside the machine's ceiling.

Producer processes (scripts.bench.load) impersonate workers: each sends its
pre-packed T_DELTA frames (`[T_DELTA, call, 1, seq, "text", data]`, data a
5-character delta) as fast as ZeroMQ takes them, then one T_FINAL per call,
and waits for the final acks. Deltas/s = all deltas / (last ack - first send):
an ack is sent only after the commit that made every delta of its call
durable, so the figure counts deltas accepted, fence-checked and persisted.

Targets, in rotated order each round:
- `sink`        the real sink process (`streamfence.sink.process.run_sink`, spawned), calls
                authorized first over its control socket; this process plays
                the supervisor and, as the calls' listener, drains their
                events (one per accepted delta) while the load runs;
- `ceil-db`     ZMQ + msgpack + SQLite WAL group commit, no fence, no events;
- `ceil-nodb`   ZMQ + msgpack alone.
With 1 producer (1 call) and 8 producers (1 call each), plus `sink 8x32`:
8 producers interleaving 32 calls each (256 streams, so a group commit holds
many calls' runs). On 2 cores, 8 producers compete with the sink for CPU.

With `SF_BENCH_BASE=TREE` in the environment, `base` runs each sink variant
with the sink of that source tree too (a checkout of the commit to compare
with), in the same rotation, and the notes give this tree's sink ÷ base per
round: an A/B in one run.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Callable
from typing import Any

import zmq

from scripts.bench.common import Section, fmt_rate, log, median, rotated, thread_cpu_seconds
from scripts.bench.load import Producers, SinkUnderTest, ceiling

DATA = "tok, "  # a token's worth of text
TARGET = 250_000


def _rate(done: list[list[Any]], total: int) -> tuple[float, int]:
    t0 = min(d[1] for d in done)
    t1 = max(d[2] for d in done)
    acked = sum(d[3] for d in done)
    return total / ((t1 - t0) / 1e9), acked


def run(quick: bool, rounds: int) -> Section:
    sec = Section("throughput", "2 sink throughput")
    total = 60_000 if quick else 400_000
    sec.params = {"rounds": rounds, "deltas per run": total, "delta data": repr(DATA)}
    shapes = {"1p": (1, 1), "8p": (8, 1), "8x32": (8, 32)}
    variants = ["ceil-nodb 1p", "ceil-db 1p", "sink 1p", "ceil-nodb 8p", "ceil-db 8p",
                "sink 8p", "sink 8x32"]
    base_tree = os.environ.get("SF_BENCH_BASE")
    if base_tree:
        variants += ["base 1p", "base 8p", "base 8x32"]
        sec.params["base tree"] = base_tree
    results: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}  # the sink's CPU s per delta
    with tempfile.TemporaryDirectory(prefix="sfbench-") as rt, \
            ceiling(rt, "ceil-nodb", with_db=False) as nodb, \
            ceiling(rt, "ceil-db", with_db=True) as withdb:
        sink = SinkUnderTest(rt)
        base = None
        if base_tree:
            os.mkdir(os.path.join(rt, "base"))
            base = SinkUnderTest(os.path.join(rt, "base"), tree=base_tree)
        producers = Producers(8, rt)
        try:
            targets = {"ceil-nodb": nodb, "ceil-db": withdb, "sink": sink.endpoints.sink_stream}
            sinks = {"sink": sink}
            if base is not None:
                targets["base"] = base.endpoints.sink_stream
                sinks["base"] = base
            for r in range(-1, rounds):  # round -1 warms up (discarded)
                for variant in rotated(variants, max(r, 0)):
                    target, shape = variant.split()
                    n_prod, n_calls = shapes[shape]
                    per_call = total // (n_prod * n_calls)
                    if r < 0:
                        per_call = max(10, 8000 // (n_prod * n_calls))
                    jobs = []
                    for _ in range(n_prod):
                        calls = [f"tp-{uuid.uuid4().hex[:12]}" for _ in range(n_calls)]
                        if target in sinks:
                            sinks[target].authorize(calls)
                        jobs.append(["blast", targets[target], calls, 1, per_call, DATA])
                    extra: dict[zmq.Socket[bytes], Callable[[zmq.Socket[bytes]], None]] | None = \
                        {sinks[target].sock: sinks[target].drain} if target in sinks else None
                    pid = sinks[target].pid if target in sinks else 0
                    cpu0 = sum(thread_cpu_seconds(pid).values()) if pid else 0.0
                    done = producers.run(jobs, extra)
                    n = per_call * n_prod * n_calls
                    if pid and r >= 0:
                        cpu[variant].append((sum(thread_cpu_seconds(pid).values()) - cpu0) / n)
                    rate, acked = _rate(done, n)
                    if acked != n_prod * n_calls:
                        raise RuntimeError(f"{variant}: {acked} of {n_prod * n_calls} finals "
                                           f"accepted: {done}")
                    if r >= 0:
                        results[variant].append(rate)
                if r >= 0:
                    log(f"  throughput round {r + 1}/{rounds}: " + ", ".join(
                        f"{v} {results[v][-1] / 1e3:.0f}k" for v in variants))
            stats = sink.stats()
        finally:
            producers.close()
            sink.close()
            if base is not None:
                base.close()
    _report(sec, results, cpu, stats)
    return sec


def _report(sec: Section, results: dict[str, list[float]], cpu: dict[str, list[float]],
            stats: dict[str, Any]) -> None:
    ref = {"ceil-nodb": "ref: ~570k–790k/s (with fence check)",
           "ceil-db": "ref: ~320k–370k/s", "sink": "ref: ~320k–370k/s (group commit)"}
    for variant, rates in results.items():
        target, shape = variant.split()
        if target == "base":
            continue  # in the notes, as ratios
        label = {"1p": "1 producer", "8p": "8 producers", "8x32": "8 producers × 32 calls"}[shape]
        name = {"ceil-nodb": "ceiling: ZMQ + msgpack", "ceil-db": "ceiling: + SQLite group commit",
                "sink": "sink: fenced + persisted"}[target]
        value = median(rates)
        if target == "sink":
            sec.row(f"{name}, {label}", fmt_rate(value), f"≥ {TARGET // 1000}k/s",
                    ref[target], value >= TARGET)
        else:
            sec.row(f"{name}, {label}", fmt_rate(value), "", ref[target])
    for shape in ("1p", "8p"):
        ratios = [s / c for s, c in zip(results[f"sink {shape}"], results[f"ceil-db {shape}"],
                                        strict=True)]
        sec.note(f"- sink ÷ ceiling (ZMQ + msgpack + SQLite), {shape}: median of per-round "
                 f"ratios {median(ratios):.2f}; per-round sink rates: "
                 + ", ".join(f"{x / 1e3:.0f}k" for x in results[f"sink {shape}"]))
    sec.note("- the sink's CPU per delta (all its threads, schedstat), median: " + ", ".join(
        f"{v} {median(c) * 1e6:.2f} µs" for v, c in cpu.items() if c))
    for shape in [x for x in ("1p", "8p", "8x32") if f"base {x}" in results]:
        ratios = [s / b for s, b in zip(results[f"sink {shape}"], results[f"base {shape}"],
                                        strict=True)]
        cpus = [s / b for s, b in zip(cpu[f"sink {shape}"], cpu[f"base {shape}"], strict=True)]
        sec.note(f"- sink ÷ base ({sec.params['base tree']}), {shape}: deltas/s, median of "
                 f"per-round ratios {median(ratios):.2f} ({', '.join(f'{r:.2f}' for r in ratios)})"
                 f"; CPU per delta {median(cpus):.2f} ({', '.join(f'{r:.2f}' for r in cpus)}); "
                 f"base rates: " + ", ".join(f"{x / 1e3:.0f}k" for x in results[f"base {shape}"]))
    sec.note(f"- sink counters after the runs: accepted {stats.get('accepted')}, dropped "
             f"{stats.get('dropped')}, rows {stats.get('db_rows')}, commits {stats.get('commits')}")
