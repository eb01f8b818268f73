"""Section 8: capacity, the most concurrent paced streams served at pace.

A level of N streams: N copies of one emulated stream at a model's pace
(CHUNKS chunks, `chunk_delay_s` 20 ms: a pacing duration of (CHUNKS - 1) × 20
ms), all opened at once, through either

- `openai-sdk`  the bare openai SDK in N threads of this process, one shared
                `openai.OpenAI` client (max_retries=0), `stream=True`; or
- `streamfence` the real daemon (openai profile, `workers_max` above the
                largest level), N calls submitted at once and read by one
                subscriber loop (scripts/bench/ttft.py's subscriber).

A stream's stretch is its first text -> its last text at the reader, over
the pacing duration: 1.0 is the provider's pace. A level is served when every
stream completed with its whole text and the p90 of the stretches is ≤ 1.1.
Each level runs once unmeasured with 2-chunk streams first (the daemon's pool
then holds N workers, as after any recent peak of N: capacity, not forks, is
measured; the SDK's connection pool is warm too).

The search, per variant: double N from START while served (up to MAX), then
bisect between the last served and the first failed level while the gap is
above max(2, 1/8 of the served level), within BISECT_STEPS; the two variants'
searches are interleaved probe by probe (rotating which goes first), and the
whole section stops at its time bound (the result then says "at least").
Reported: each maximum, streamfence's ÷ the SDK's (target ≥ 1.0), every probe
in the details.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx2
import openai

from scripts.bench import ttft
from scripts.bench.common import (
    Section,
    daemon,
    emulator,
    log,
    percentile,
    providers_for,
    raise_fd_limit,
    realistic_text,
)
from streamfence.devtools.emulator.control import EmulatorProcess
from streamfence.devtools.launcher import DaemonProcess

VARIANTS = ("openai-sdk", "streamfence")
STRETCH_MAX = 1.1
RATIO_TARGET = 1.0
START = 8
MAX = 256
BISECT_STEPS = 3


@dataclass
class Search:
    """One variant's search: the largest level served, the smallest failed."""

    variant: str
    served: int = 0
    failed: int | None = None
    bisections: int = 0
    # (n, p90 stretch, the emulator's own p90 stretch, why not served or "")
    probes: list[tuple[int, float, float, str]] = field(default_factory=list)

    def next_level(self, top: int = MAX) -> int | None:
        if self.failed is None:
            nxt = min(START, top) if not self.served else self.served * 2
            return nxt if nxt <= top else None
        gap = self.failed - self.served
        if gap <= max(2, self.served // 8) or self.bisections >= BISECT_STEPS:
            return None
        self.bisections += 1
        return self.served + gap // 2

    def record(self, n: int, p90: float, emu90: float, why: str) -> None:
        self.probes.append((n, p90, emu90, why))
        if not why:
            self.served = max(self.served, n)
        else:
            self.failed = n if self.failed is None else min(self.failed, n)


class Prober:
    def __init__(self, emu: EmulatorProcess, proc: DaemonProcess, sdk: openai.OpenAI,
                 chunks: int) -> None:
        self.control = emu.client()
        self.proc = proc
        self.sdk = sdk
        self.chunks = chunks
        self.text = realistic_text(chunks)

    def _streams(self, variant: str, n: int, chunks: int, text: str) -> list[ttft.Call]:
        calls = ttft._script(self.control, n, chunks, text)
        if variant == "streamfence":
            ttft._sf_burst(self.proc, calls)
        else:
            ttft._sdk_burst(self.sdk, calls)
        return calls

    def probe(self, variant: str, n: int) -> tuple[float, float, str]:
        """(p90 stretch, the emulator's own p90 stretch (its first to last write,
        for reference: its sleeps overshoot), why it is not served or "")."""
        self._streams(variant, n, 2, realistic_text(2))  # the pool / connections for N
        since = int(self.control.health()["requests"])
        calls = self._streams(variant, n, self.chunks, self.text)
        bad = [c for c in calls if c.error or c.text != self.text or c.pieces != self.chunks]
        pace = (self.chunks - 1) * ttft.DELAY_S
        stretch = sorted((c.last - c.first) / pace for c in calls if c.pieces > 1)
        p90 = percentile(stretch, 90)
        emu = sorted((r["last_write"] - r["started"]) / pace for r in self.control.log(since=since)
                     if r.get("last_write") and r.get("started"))
        emu90 = percentile(emu, 90)
        if bad:
            return p90, emu90, f"{len(bad)} incomplete ({bad[0].error or 'short text'})"[:120]
        if p90 > STRETCH_MAX:
            return p90, emu90, f"p90 stretch {p90:.2f}"
        return p90, emu90, ""


def run(quick: bool, rounds: int, top: int | None = None, chunks: int | None = None,
        bound_s: float | None = None) -> Section:
    """`top`: the largest level (default MAX, 64 quick); `chunks` per stream
    (default 100, 50 quick); `bound_s`: the time bound (default 180 s, 60 quick).
    `rounds` is unused: one search per variant, interleaved."""
    sec = Section("capacity", "8 capacity")
    chunks = chunks or (50 if quick else 100)
    bound_s = bound_s or (60.0 if quick else 180.0)
    top = top or (64 if quick else MAX)
    sec.params = {"chunks per stream": chunks, "chunk_delay_s": ttft.DELAY_S,
                  "served": f"all complete and p90 stretch ≤ {STRETCH_MAX}",
                  "levels": f"{START}, doubling to {top}, then ≤ {BISECT_STEPS} bisections",
                  "time bound": f"{bound_s:.0f} s", "RLIMIT_NOFILE": raise_fd_limit()}
    searches = {v: Search(v) for v in VARIANTS}
    started = time.monotonic()
    cut = False
    with emulator() as emu, daemon(providers_for(emu, stale_timeout_s=120.0),
                                   {"workers_max": top + 16, "queue_max": 10 * top},
                                   ready_timeout=180.0) as proc:
        sdk = openai.OpenAI(base_url=emu.openai_base_url, api_key="bench", max_retries=0,
                            http_client=httpx2.Client(
                                trust_env=False, timeout=60.0,
                                limits=openai.DEFAULT_CONNECTION_LIMITS))
        prober = Prober(emu, proc, sdk, chunks)
        try:
            step = 0
            while True:
                order = VARIANTS[step % 2:] + VARIANTS[:step % 2]
                levels: dict[str, int] = {}
                for v in order:
                    n = searches[v].next_level(top)
                    if n is not None:
                        levels[v] = n
                if not levels:
                    break
                if time.monotonic() - started > bound_s:
                    cut = True
                    break
                for v, n in levels.items():
                    p90, emu90, why = prober.probe(v, n)
                    searches[v].record(n, p90, emu90, why)
                    log(f"  capacity {v} {n} streams: p90 stretch {p90:.2f} (emulator's own "
                        f"{emu90:.2f}) {'served' if not why else 'NOT served: ' + why}")
                step += 1
        finally:
            sdk.close()
    _report(sec, searches, cut, top)
    return sec


def _report(sec: Section, searches: dict[str, Search], cut: bool, top: int) -> None:
    def shown(s: Search) -> str:
        if s.failed is None:
            return f"≥ {s.served}" + (" (the largest level tried)" if s.served >= top else "")
        return f"{s.served}" + (" (at least; search cut at its time bound)" if cut else "")

    for v in VARIANTS:
        s = searches[v]
        sec.row(f"max paced streams at stretch ≤ {STRETCH_MAX} (p90): {v}", shown(s))
    sdk, sf = searches["openai-sdk"].served, searches["streamfence"].served
    ratio = sf / sdk if sdk else float("nan")
    sec.row("capacity streamfence ÷ SDK", f"{ratio:.2f}", f"≥ {RATIO_TARGET}", "",
            ratio >= RATIO_TARGET if sdk else None)
    for v in VARIANTS:
        probes = ", ".join(f"{n}: {p90:.2f} ({emu90:.2f}){'' if not why else ' ✗'}"
                           for n, p90, emu90, why in searches[v].probes)
        sec.note(f"- {v}: level: p90 stretch (the emulator's own p90 stretch, its first to "
                 f"last write; ✗ not served): {probes}")
    why: dict[str, Any] = {v: [w for *_, w in searches[v].probes if w] for v in VARIANTS}
    if any(why.values()):
        sec.note("- why levels were not served: " + "; ".join(
            f"{v}: {', '.join(ws)}" for v, ws in why.items() if ws))
