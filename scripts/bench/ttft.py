"""Section 7: time to first token of a burst arriving at an idle daemon.

The same emulated stream at a model's pace (`chunk_delay_s` 20 ms, 50 chunks;
10 chunks for the 200-call burst, to keep the section short; the emulator
writes the first chunk at once) is opened by bursts of 1, 32 and 200 calls,
side by side in one run (each round, per burst size, the two variants in
rotated order):

- `openai-sdk`  the bare openai SDK: one shared `openai.OpenAI` client
                (max_retries=0) pointed at the emulator, one thread per call
                (started beforehand and released at once),
                `chat.completions.create(stream=True)`; TTFT = the thread's
                request -> its first chunk with content;
- `streamfence` the real daemon (openai profile on the same emulator): every
                call of the burst submitted (subscribed) back to back on one
                client socket, the events of all read by one loop; TTFT = the
                call's submit -> its first text delta.

- `sf-old-pool` (burst 32 only, the baseline of issue 32's pool change) the
                daemon with the pool of before: `workers_spare` 32 and the
                spares forked at once (`workers_refill_wait_s` 0);
- `sf-32-spares` (burst 32 only) `workers_spare` 32, the refill waiting
                (the default): what the wait alone changes.

Each burst meets an idle daemon: a fresh one per burst (the pool's keys at
their defaults, unless the variant says otherwise; `workers_max` large enough
for the burst), which has served one call (so its supervisor and sink paths
are not cold) and then settled (no call, the same idle workers for 0.5 s).

And one burst of 32 on a daemon idle 10 minutes (its pool shrunk to its
floor): scripts/bench/long_idle.py, whose daemon `__main__` starts before the
first section, bursts it at the end of this section. Reported per burst: p50 and p90
of the TTFTs of all calls of all rounds, the added p50 (streamfence − SDK,
ms) and the ratio of p90s, per-round ranges, and where streamfence's time
went: submit -> attempt scheduled (the journal's `started`), scheduled ->
request at the emulator (the emulator's log), request -> first delta at the
subscriber; plus the forks the burst caused. For bursts of 32 and more, the
same burst again REPEAT_AFTER_S after the first one ended (the pool keeps
the workers of a recent peak): TTFT when the workers exist.

Targets (issue 32): added p50 ≤ 5 ms and p90 ≤ 1.25× the SDK's, at bursts
of 1 and 32, on a daemon idle 5 s and on one idle 10 minutes.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx2
import openai

from scripts.bench.common import (
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
    rotated,
    wait_quiet,
)
from streamfence.config.model import DaemonConfig
from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess
from streamfence.devtools.launcher import DaemonProcess
from streamfence.protocol.client_base import new_ref

if TYPE_CHECKING:
    from scripts.bench.long_idle import LongIdle

DaemonFactory = Callable[..., AbstractContextManager[DaemonProcess]]

VARIANTS = ("openai-sdk", "streamfence")
OLD_POOL = "sf-old-pool"
SPARES_32 = "sf-32-spares"
OLD_POOL_BURSTS = (32,)
POOLS: dict[str, dict[str, Any]] = {  # the variants' pool keys beyond the defaults
    OLD_POOL: {"workers_spare": 32, "workers_refill_wait_s": 0.0},
    SPARES_32: {"workers_spare": 32},
}
PROMPT = [{"role": "user", "content": "Write a short paragraph."}]
DELAY_S = 0.02
ADDED_P50_TARGET_S = 0.005
P90_RATIO_TARGET = 1.25
TARGET_BURSTS = (1, 32)
DEFAULT_SPARE = next(f.default for f in dataclasses.fields(DaemonConfig) if f.name == "workers_spare")
REPEAT_MIN = 32
REPEAT_AFTER_S = 5.0


@dataclass(slots=True)
class Call:
    model: str
    key: str
    t0: float = 0.0  # perf_counter at submit / request
    w0: float = 0.0  # time.time() at submit / request
    first: float = 0.0  # perf_counter at the first text
    wfirst: float = 0.0
    last: float = 0.0  # perf_counter at the last text
    pieces: int = 0  # text chunks / deltas received
    call_id: str = ""
    text: str = ""
    error: str = ""


def _script(control: EmulatorClient, n: int, chunks: int, text: str) -> list[Call]:
    calls = []
    for _ in range(n):
        key = f"tt-{uuid.uuid4().hex[:10]}"
        control.script(key, [{"fault": "ok", "chunks": chunks, "chunk_delay_s": DELAY_S,
                              "text": text}])
        calls.append(Call(f"emu-model#{key}", key))
    return calls


# ---- the bare SDK ----------------------------------------------------------------

def _sdk_burst(sdk: openai.OpenAI, calls: list[Call]) -> None:
    """One thread per call, all started first and released together."""
    go = threading.Event()
    ready = threading.Semaphore(0)
    client: Any = sdk  # the SDK's overloads are too narrow for a bench's model names

    def one(call: Call) -> None:
        ready.release()
        go.wait()
        parts: list[str] = []
        call.t0, call.w0 = time.perf_counter(), time.time()
        try:
            stream = client.chat.completions.create(model=call.model, messages=PROMPT,
                                                    stream=True)
            for chunk in stream:
                if chunk.choices:
                    content = chunk.choices[0].delta.content
                    if content:
                        call.last = time.perf_counter()
                        if not call.first:
                            call.first, call.wfirst = call.last, time.time()
                        call.pieces += 1
                        parts.append(content)
        except Exception as exc:
            call.error = f"{type(exc).__name__}: {exc}"
        call.text = "".join(parts)

    threads = [threading.Thread(target=one, args=(c,), daemon=True) for c in calls]
    for t in threads:
        t.start()
    for _ in threads:
        ready.acquire()
    time.sleep(0.05)  # every thread is parked on the event
    go.set()
    for t in threads:
        t.join(timeout=120.0)


# ---- streamfence ----------------------------------------------------------------

def _sf_burst(proc: DaemonProcess, calls: list[Call]) -> None:
    """Submit every call (subscribed) back to back, then read all their events in
    one loop. The client library's wire on raw sockets (common.RawClient), as
    section 5 does: one asyncio task per call would add the tasks' scheduling
    to what is measured (the daemon's path to the first token)."""
    raw = RawClient(proc)
    try:
        zmq_streams(raw, calls)
    finally:
        raw.close()


def zmq_streams(raw: RawClient, calls: list[Call]) -> None:
    """Submit every call (subscribed) back to back on `raw`, then read all their
    events in one loop (sections 7, 9 and 10)."""
    by_ref: dict[str, Call] = {}
    by_call: dict[str, Call] = {}
    parts: dict[str, list[str]] = {}
    for call in calls:
        ref = new_ref()
        by_ref[ref] = call
        frame = raw.submit_frame(ref, call.model, PROMPT)
        call.t0, call.w0 = time.perf_counter(), time.time()
        raw.req.send(frame)
    finished = 0
    deadline = time.monotonic() + 120.0
    while finished < len(calls) and time.monotonic() < deadline:
        for msg in raw.messages(200):
            op = msg.get("op")
            if op == "delta":
                call = by_call[msg["call_id"]]
                if msg["kind"] == "text":
                    call.last = time.perf_counter()
                    if not call.first:
                        call.first, call.wfirst = call.last, time.time()
                    call.pieces += 1
                    parts[call.call_id].append(msg["data"])
            elif op == "accepted":
                call = by_ref[msg["ref"]]
                call.call_id = msg["call_id"]
                by_call[call.call_id] = call
                parts[call.call_id] = []
            elif op == "done":
                call = by_call[msg["call_id"]]
                if msg["status"] != "completed":
                    call.error = f"ended {msg['status']}: {msg.get('error')}"
                call.text = "".join(parts[call.call_id])
                finished += 1
            elif op == "error":
                raise RuntimeError(f"the daemon refused a call: {msg}")
    for call in calls:
        if not call.text and not call.error:
            call.error = "no done within 120 s"


def _settle(proc: DaemonProcess, quiet_s: float = 0.5, timeout_s: float = 60.0) -> int:
    """Wait until no call is active and the set of idle workers has not changed
    for `quiet_s`, then until the daemon is quiet (new spares warm up after
    their hello); returns the number of idle workers."""
    with proc.client(timeout_s=30.0) as client:
        last: tuple[Any, ...] = ()
        since = time.monotonic()
        deadline = since + timeout_s
        while time.monotonic() < deadline:
            status = client.status()
            workers = status["workers"]
            shape = (status["calls"]["active"],
                     tuple(sorted(w["worker_id"] for w in workers if w["state"] == "idle")),
                     len(workers))
            if shape != last:
                last, since = shape, time.monotonic()
            elif shape[0] == 0 and shape[1] and len(shape[1]) == shape[2] \
                    and time.monotonic() - since >= quiet_s:
                wait_quiet(proc)
                return len(shape[1])
            time.sleep(0.05)
    raise TimeoutError("the daemon did not settle")


def _pool_counts(proc: DaemonProcess) -> dict[str, int]:
    with proc.client(timeout_s=30.0) as client:
        status = client.status()
    return {"spawned_total": int(status["pool"]["spawned_total"]),
            "workers": len(status["workers"])}


def _sf_run(emu: EmulatorProcess, n: int, chunks: int, text: str,
            start: DaemonFactory = daemon, pool: dict[str, Any] | None = None) -> dict[str, Any]:
    control = emu.client()
    settings = {"workers_max": max(64, n + 16), "queue_max": 10 * n + 100,
                "workers_spare": DEFAULT_SPARE, **(pool or {})}
    with start(providers_for(emu, stale_timeout_s=120.0), settings,
               ready_timeout=180.0) as proc:
        # One call first: the daemon has served before (an idle daemon, not a cold one).
        warm = _script(control, 1, 4, realistic_text(4))
        _sf_burst(proc, warm)
        idle_before = _settle(proc)
        before = _pool_counts(proc)
        since = int(control.health()["requests"])
        calls = _script(control, n, chunks, text)
        t = time.perf_counter()
        _sf_burst(proc, calls)
        wall = time.perf_counter() - t
        after = _pool_counts(proc)
        again: list[Call] = []
        if n >= REPEAT_MIN:
            time.sleep(REPEAT_AFTER_S)
            again = _script(control, n, chunks, text)
            _sf_burst(proc, again)
        started = dict(proc.journal_rows("SELECT call_id, started FROM attempts "
                                         "WHERE attempt = 1"))
    at_emu = {r["key"]: r["started"] for r in control.log(since=since)}
    parts = [(started[c.call_id] - c.w0, at_emu[c.key] - started[c.call_id],
              c.wfirst - at_emu[c.key])
             for c in calls if c.first and c.call_id in started and c.key in at_emu]
    return {"calls": calls, "wall": wall, "parts": parts, "idle_before": idle_before,
            "forks": after["spawned_total"] - before["spawned_total"],
            "workers_after": after["workers"], "again": again}


def _sdk_run(emu: EmulatorProcess, sdk: openai.OpenAI, n: int, chunks: int,
             text: str) -> dict[str, Any]:
    control = emu.client()
    warm = _script(control, 1, 4, realistic_text(4))
    _sdk_burst(sdk, warm)
    time.sleep(0.5)
    since = int(control.health()["requests"])
    calls = _script(control, n, chunks, text)
    t = time.perf_counter()
    _sdk_burst(sdk, calls)
    wall = time.perf_counter() - t
    at_emu = {r["key"]: r["started"] for r in control.log(since=since)}
    parts = [(at_emu[c.key] - c.w0, c.wfirst - at_emu[c.key])
             for c in calls if c.first and c.key in at_emu]
    return {"calls": calls, "wall": wall, "parts": parts}


def _check(variant: str, res: dict[str, Any], text: str) -> list[float]:
    calls: list[Call] = res["calls"]
    bad = [c for c in calls if c.error or c.text != text or not c.first]
    if bad:
        c = bad[0]
        raise RuntimeError(f"{variant}: {len(bad)}/{len(calls)} calls failed; first: "
                           f"{c.error or f'received {len(c.text)} chars of {len(text)}'}")
    return sorted(c.first - c.t0 for c in calls)


# ---- the section ----------------------------------------------------------------

def _variants(n: int) -> tuple[str, ...]:
    return (*VARIANTS, SPARES_32, OLD_POOL) if n in OLD_POOL_BURSTS else VARIANTS


def run(quick: bool, rounds: int, bursts: list[tuple[int, int]] | None = None,
        long_idle: LongIdle | None = None) -> Section:
    """`bursts`: (calls, chunks) per burst (default 1 × 50, 32 × 50, 200 × 10;
    quick: 1 × 20, 32 × 20). `long_idle`: the daemon idle 10 minutes, burst
    with 32 calls at the end (closed here)."""
    sec = Section("ttft", "7 TTFT of a burst")
    if bursts is None:
        bursts = [(1, 20), (32, 20)] if quick else [(1, 50), (32, 50), (200, 10)]
    sec.params = {"rounds": rounds, "bursts (calls × chunks)": ", ".join(
        f"{n} × {c}" for n, c in bursts), "chunk_delay_s": DELAY_S,
        "daemon": "fresh per burst, one call served, settled; the pool's keys at their "
                  f"defaults (workers_spare {DEFAULT_SPARE}); " + "; ".join(
                      f"{name}: " + ", ".join(f"{k} {v}" for k, v in pool.items())
                      for name, pool in POOLS.items()),
        "RLIMIT_NOFILE": raise_fd_limit()}
    results: dict[int, dict[str, list[dict[str, Any]]]] = {
        n: {v: [] for v in _variants(n)} for n, _ in bursts}
    try:
        with emulator() as emu:
            sdk = openai.OpenAI(base_url=emu.openai_base_url, api_key="bench", max_retries=0,
                                http_client=httpx2.Client(
                                    trust_env=False, timeout=60.0,
                                    limits=openai.DEFAULT_CONNECTION_LIMITS))
            try:
                for r in range(rounds):
                    for n, chunks in bursts:
                        _round(emu, sdk, n, chunks, r, results[n])
                        log(f"  ttft round {r + 1}/{rounds}, burst {n}: " + ", ".join(
                            f"{v} p50 {percentile(results[n][v][-1]['ttft'], 50) * 1e3:.1f} / "
                            f"p90 {percentile(results[n][v][-1]['ttft'], 90) * 1e3:.1f} ms"
                            for v in _variants(n)))
            finally:
                sdk.close()
        for n, chunks in bursts:
            _report(sec, n, chunks, results[n])
        if long_idle is not None:
            long_idle.run(sec, dict(bursts), results)
    finally:
        if long_idle is not None:
            long_idle.close()
    return sec


def _round(emu: EmulatorProcess, sdk: openai.OpenAI, n: int, chunks: int, r: int,
           results: dict[str, list[dict[str, Any]]]) -> None:
    text = realistic_text(chunks)
    for variant in rotated(_variants(n), r):
        if variant == "openai-sdk":
            res = _sdk_run(emu, sdk, n, chunks, text)
        else:
            res = _sf_run(emu, n, chunks, text, pool=POOLS.get(variant))
        res["ttft"] = _check(variant, res, text)
        if res.get("again"):
            res["ttft_again"] = _check(variant, {"calls": res["again"]}, text)
        results[variant].append(res)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _report(sec: Section, n: int, chunks: int, res: dict[str, list[dict[str, Any]]]) -> None:
    pooled = {v: sorted(t for r in res[v] for t in r["ttft"]) for v in res}
    p = {v: (percentile(pooled[v], 50), percentile(pooled[v], 90)) for v in res}
    for v in res:
        sec.row(f"burst {n} ({chunks} chunks @ {1 / DELAY_S:.0f}/s): {v}",
                f"p50 {_ms(p[v][0])} ms, p90 {_ms(p[v][1])} ms")
    for v, what in ((SPARES_32, "32 spares, their refill waiting"),
                    (OLD_POOL, "baseline: the pool before issue 32")):
        if v in res:
            sec.row(f"burst {n}, {v}: added p50, p90 ÷ SDK",
                    f"{(p[v][0] - p['openai-sdk'][0]) * 1e3:+.1f} ms, "
                    f"{p[v][1] / p['openai-sdk'][1]:.2f}", "", what)
    added = p["streamfence"][0] - p["openai-sdk"][0]
    ratio = p["streamfence"][1] / p["openai-sdk"][1]
    targeted = n in TARGET_BURSTS
    sec.row(f"burst {n}: added p50 (streamfence − SDK)", f"{added * 1e3:+.1f} ms",
            f"≤ {ADDED_P50_TARGET_S * 1e3:.0f} ms" if targeted else "", "",
            added <= ADDED_P50_TARGET_S if targeted else None)
    sec.row(f"burst {n}: p90 streamfence ÷ SDK", f"{ratio:.2f}",
            f"≤ {P90_RATIO_TARGET}" if targeted else "", "",
            ratio <= P90_RATIO_TARGET if targeted else None)

    again = sorted(t for r in res["streamfence"] for t in r.get("ttft_again", []))
    if again:
        p50, p90 = percentile(again, 50), percentile(again, 90)
        sdk50, sdk90 = p["openai-sdk"]
        sec.row(f"burst {n} again {REPEAT_AFTER_S:.0f} s later (workers kept): streamfence",
                f"p50 {_ms(p50)} ms, p90 {_ms(p90)} ms (added p50 "
                f"{(p50 - sdk50) * 1e3:+.1f} ms, p90 ÷ SDK {p90 / sdk90:.2f})")

    def rng(v: str, q: float) -> str:
        vals = [percentile(r["ttft"], q) * 1e3 for r in res[v]]
        return f"{min(vals):.1f}–{max(vals):.1f}"

    sf = res["streamfence"]
    split = ", ".join(
        f"{name} p50 {_ms(median([x[i] for r in sf for x in r['parts']]))} / p90 "
        f"{_ms(percentile(sorted(x[i] for r in sf for x in r['parts']), 90))} ms"
        for i, name in enumerate(("submit → attempt scheduled",
                                  "scheduled → request at the emulator",
                                  "request → first delta at the subscriber")))
    sdk_split = ", ".join(
        f"{name} p50 {_ms(median([x[i] for r in res['openai-sdk'] for x in r['parts']]))} ms"
        for i, name in enumerate(("request → at the emulator",
                                  "at the emulator → first chunk in the thread")))
    sec.note(f"- burst {n} × {chunks} chunks: per-round p50 ranges: SDK {rng('openai-sdk', 50)}"
             f" ms, streamfence {rng('streamfence', 50)} ms; per-round p90 ranges: SDK "
             f"{rng('openai-sdk', 90)} ms, streamfence {rng('streamfence', 90)} ms; max SDK "
             f"{_ms(pooled['openai-sdk'][-1])} ms, streamfence {_ms(pooled['streamfence'][-1])}"
             f" ms. streamfence split: {split}. SDK split: {sdk_split}. Idle workers before "
             f"each burst: {sorted({r['idle_before'] for r in sf})}; forks during the burst: "
             f"{[r['forks'] for r in sf]}; workers after: {[r['workers_after'] for r in sf]}.")
    for v in (SPARES_32, OLD_POOL):
        if v in res:
            sec.note(f"- burst {n}, {v}: scheduled → request at the emulator p50 "
                     f"{_ms(median([x[1] for r in res[v] for x in r['parts']]))} ms; idle "
                     f"workers before: {sorted({r['idle_before'] for r in res[v]})}; forks "
                     f"during the burst: {[r['forks'] for r in res[v]]}.")
