"""Section 5: scale, with 50, 200 and 500 concurrent paced streams.

For each level N: a fresh daemon with `workers_spare` N and `workers_max`
N + 8 (so N workers are warm before the load; the time to get them is
reported too), then N calls submitted at once from one DEALER subscriber in
this process (raw protocol, msgpack: the client library is not built for
500 calls on one socket). Each call streams CHUNKS text chunks at its own
pace, drawn from 30-80 chunks/s (seeded), as the emulator's `chunk_delay_s`.

Reported per level:
- completion: calls `completed` / N (every call must complete);
- TTFT p50/p99: submit -> the subscriber holds the first delta;
- done latency p99: the emulator finished writing a stream (`ended`) -> the
  subscriber holds its `done` (final ack, decision, finish commit, fan-out);
- stretch p99: a stream's delivery span / its scripted span ((CHUNKS-1)/rate):
  1.0 means delivered at the provider's pace;
- CPU: all daemon processes + this subscriber, in cores over the load's wall
  time; the emulator's share separately (a core at 100 % would make it the
  bottleneck);
- memory: USS and PSS of each worker after its stream (psutil
  memory_full_info = /proc/PID/smaps_rollup); file descriptors of the
  supervisor and the sink while all streams run.
"""

from __future__ import annotations

import random
import time
import uuid
from typing import Any

import psutil

from scripts.bench.common import (
    CpuMeter,
    MiB,
    RawClient,
    Section,
    daemon,
    emulator,
    log,
    median,
    percentile,
    providers_for,
    raise_fd_limit,
    realistic_text,
)
from streamfence.devtools.emulator.control import EmulatorProcess
from streamfence.devtools.launcher import DaemonProcess, wait_until
from streamfence.protocol.client_base import new_ref

USS_TARGET_MIB = 16.0


class Stream:
    __slots__ = ("call_id", "deltas", "done_at", "first", "key", "last", "rate", "status",
                 "submitted")

    def __init__(self, key: str, rate: float) -> None:
        self.key = key
        self.rate = rate
        self.call_id = ""
        self.submitted = 0.0
        self.first = 0.0
        self.last = 0.0
        self.deltas = 0
        self.done_at = 0.0
        self.status = ""


def _level(n: int, chunks: int, rng: random.Random) -> dict[str, Any]:
    out: dict[str, Any] = {"n": n}
    with emulator() as emu:
        t0 = time.monotonic()
        with daemon(providers_for(emu, stale_timeout_s=120.0),
                    {"workers_spare": n, "workers_max": n + 8, "queue_max": 10 * n},
                    ready_timeout=180.0) as proc:
            return _load(out, emu, proc, n, chunks, rng, t0)


def _load(out: dict[str, Any], emu: EmulatorProcess, proc: DaemonProcess, n: int, chunks: int,
          rng: random.Random, t0: float) -> dict[str, Any]:
    assert proc.proc is not None and emu.pid is not None
    with proc.client(timeout_s=30.0) as client:
        def warm() -> bool:
            idle = sum(1 for w in client.status()["workers"] if w["state"] == "idle")
            return idle >= n

        wait_until(warm, 300.0, f"{n} idle workers", interval=0.05)
        out["pool_ready_s"] = time.monotonic() - t0
        status = client.status()
    control = emu.client()
    text = realistic_text(chunks)
    streams: dict[str, Stream] = {}
    for i in range(n):
        s = Stream(f"sc{n}-{i}-{uuid.uuid4().hex[:6]}", rng.uniform(30.0, 80.0))
        control.script(s.key, [{"fault": "ok", "chunks": chunks, "chunk_delay_s": 1 / s.rate,
                                "text": text}])
        streams[s.key] = s
    since = int(control.health()["requests"])
    roles = {pid: role for role, pid in status["processes"].items()}
    meter = CpuMeter([proc.proc.pid])
    emu_meter = CpuMeter([emu.pid])
    raw = RawClient(proc)
    by_ref: dict[str, Stream] = {}
    by_call: dict[str, Stream] = {}
    meter.start()
    emu_meter.start()
    machine0 = psutil.cpu_times()
    own0 = time.process_time()
    start = time.time()
    for s in streams.values():
        ref = new_ref()
        by_ref[ref] = s
        s.submitted = time.time()
        raw.req.send(raw.submit_frame(ref, f"m#{s.key}", []))
    fds: dict[str, int] = {}
    finished = 0
    deadline = time.monotonic() + 60.0 + chunks / 30.0 * 4
    while finished < n and time.monotonic() < deadline:
        for msg in raw.messages(200):
            now = time.time()
            op = msg.get("op")
            if op == "delta":
                s = by_call[msg["call_id"]]
                if not s.deltas:
                    s.first = now
                s.deltas += 1
                s.last = now
            elif op == "accepted":
                s = by_ref[msg["ref"]]
                s.call_id = msg["call_id"]
                by_call[s.call_id] = s
            elif op == "done":
                s = by_call[msg["call_id"]]
                s.done_at, s.status = now, msg["status"]
                finished += 1
            elif op == "error":
                raise RuntimeError(f"scale {n}: the daemon refused a call: {msg}")
        if not fds and sum(1 for s in streams.values() if s.deltas) == n:
            for role in ("supervisor", "sink"):
                fds[role] = psutil.Process(status["processes"][role]).num_fds()
    elapsed = time.time() - start
    own = time.process_time() - own0
    out["machine_busy"] = _busy(machine0, psutil.cpu_times()) / elapsed
    meter.stop()
    emu_meter.stop()
    raw.close()
    out["fds"] = fds
    out["elapsed"] = elapsed
    out["cpu_daemon"] = meter.total()
    out["cpu_own"] = own
    out["cpu_emu"] = emu_meter.total()
    out["cpu_by_role"] = _by_role(meter.used, roles)
    out["completed"] = sum(1 for s in streams.values() if s.status == "completed")
    out["deltas"] = sum(s.deltas for s in streams.values())
    out["memory"] = _memory(proc, status)
    ended = {r["key"]: r for r in control.log(since=since)}
    out["ttft"] = sorted(s.first - s.submitted for s in streams.values() if s.first)
    out["done_lat"] = sorted(s.done_at - ended[s.key]["ended"] for s in streams.values()
                             if s.done_at and ended.get(s.key, {}).get("ended"))
    sched = dict(proc.journal_rows("SELECT call_id, started FROM attempts WHERE attempt = 1"))
    out["ttft_parts"] = [
        (sched[s.call_id] - s.submitted, ended[s.key]["started"] - sched[s.call_id],
         s.first - ended[s.key]["started"])
        for s in streams.values() if s.first and s.call_id in sched and s.key in ended]
    out["stretch"] = sorted((s.last - s.first) / ((chunks - 1) / s.rate)
                            for s in streams.values() if s.deltas == chunks)
    return out


def _busy(before: Any, after: Any) -> float:
    """CPU seconds the whole machine was busy (not idle, not waiting for I/O)."""
    def busy(t: Any) -> float:
        return float(sum(t) - t.idle - getattr(t, "iowait", 0.0))

    return busy(after) - busy(before)


def _by_role(used: dict[int, float], roles: dict[int, str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for pid, value in used.items():
        role = roles.get(pid, "workers")
        out[role] = out.get(role, 0.0) + value
    return out


def _memory(proc: DaemonProcess, before: dict[str, Any]) -> dict[str, Any]:
    with proc.client(timeout_s=30.0) as client:
        status = client.status()
    uss, pss = [], []
    for w in status["workers"]:
        try:
            info = psutil.Process(w["pid"]).memory_full_info()
        except psutil.NoSuchProcess:
            continue
        uss.append(info.uss / MiB)
        pss.append(info.pss / MiB)
    roles = {}
    for role, pid in status["processes"].items():
        info = psutil.Process(pid).memory_full_info()
        roles[role] = (info.uss / MiB, info.pss / MiB)
    return {"uss": sorted(uss), "pss": sorted(pss), "roles": roles,
            "available_gib": psutil.virtual_memory().available / MiB / 1024}


def run(quick: bool, rounds: int, levels: list[int] | None = None, seed: int = 1234) -> Section:
    sec = Section("scale", "5 scale")
    chunks = 40 if quick else 150
    levels = levels or ([20] if quick else [50, 200, 500])
    sec.params = {"levels": levels, "chunks per stream": chunks, "pace": "30–80 chunks/s",
                  "seed": seed, "RLIMIT_NOFILE": raise_fd_limit()}
    rng = random.Random(seed)
    for n in levels:
        t = time.monotonic()
        res = _level(n, chunks, rng)
        log(f"  scale {n}: {res['completed']}/{n} completed in {res['elapsed']:.1f} s "
            f"(pool ready {res['pool_ready_s']:.1f} s, level {time.monotonic() - t:.0f} s)")
        _report(sec, res, chunks)
    return sec


def _report(sec: Section, res: dict[str, Any], chunks: int) -> None:
    n = res["n"]
    wall = res["elapsed"]
    cores = (res["cpu_daemon"] + res["cpu_own"]) / wall
    ttft, done_lat, stretch = res["ttft"], res["done_lat"], res["stretch"]
    mem = res["memory"]
    uss_med, uss_max = median(mem["uss"]), max(mem["uss"] or [float("nan")])
    sec.row(f"{n} streams: completed", f"{res['completed']}/{n} in {wall:.1f} s",
            "all complete" if n == 500 else "", "", res["completed"] == n if n == 500 else None)
    sec.row(f"{n} streams: latency p99",
            f"TTFT {percentile(ttft, 99) * 1e3:.0f} ms, done {percentile(done_lat, 99) * 1e3:.0f}"
            f" ms, stretch {percentile(stretch, 99):.2f}×")
    sec.row(f"{n} streams: CPU", f"{cores:.2f} cores (+ emulator {res['cpu_emu'] / wall:.2f}), "
            f"{(res['cpu_daemon'] + res['cpu_own']) / max(1, res['deltas']) * 1e6:.0f} µs/delta")
    sec.row(f"{n} streams: USS per worker", f"median {uss_med:.1f} MiB (max {uss_max:.1f}), "
            f"PSS {median(mem['pss']):.1f} MiB", f"≤ {USS_TARGET_MIB:.0f} MiB",
            "ref: ~16 MiB zygote child", uss_max <= USS_TARGET_MIB)
    roles = ", ".join(f"{k} {v / wall:.2f}" for k, v in sorted(res["cpu_by_role"].items()))
    parts = res["ttft_parts"]
    split = ", ".join(
        f"{name} p50 {percentile(sorted(p[i] for p in parts), 50) * 1e3:.0f} ms"
        for i, name in enumerate(("submit → attempt scheduled", "scheduled → request at the "
                                  "emulator", "request → first delta at the subscriber")))
    procs = ", ".join(f"{k} USS {u:.1f} / PSS {p:.1f} MiB" for k, (u, p) in mem["roles"].items())
    sec.note(f"- {n} streams × {chunks} chunks: warm pool of {n} ready in "
             f"{res['pool_ready_s']:.1f} s; {res['deltas']:,} deltas in {wall:.1f} s "
             f"({res['deltas'] / wall:,.0f}/s); TTFT p50 {percentile(ttft, 50) * 1e3:.0f} ms; "
             f"done latency p50 {percentile(done_lat, 50) * 1e3:.0f} ms; stretch p50 "
             f"{percentile(stretch, 50):.2f}×; TTFT split: {split}; cores by process: {roles}, "
             f"subscriber {res['cpu_own'] / wall:.2f}, the whole machine busy "
             f"{res['machine_busy']:.2f} of its cores; {procs}; fds while all streams ran: "
             f"{res['fds'] or 'not sampled'}; memory available after: "
             f"{mem['available_gib']:.1f} GiB.")
