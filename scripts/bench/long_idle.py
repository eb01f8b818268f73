"""Section 7's burst on a daemon idle 10 minutes (issue 32: the cold-burst
target "also on a daemon idle 10 minutes, after the pool has shrunk").

The full bench runs for more than 15 minutes, so the daemon (and its own
emulator) is started when the bench starts (`__main__`, before the first
section: `--long-idle-s`, default 600), served one call, and left idle while
the other sections run; `ttft` bursts it with LONG_IDLE_BURST calls at its
end, waiting out what is left of the idle time if the sections before were
quicker. One sample of 32 calls, beside the SDK's burst-32 figures of the
same section (one daemon can only be idle for the first time once).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from scripts.bench.common import (
    Section,
    daemon,
    emulator,
    log,
    median,
    percentile,
    providers_for,
    realistic_text,
)
from scripts.bench.ttft import (
    ADDED_P50_TARGET_S,
    DEFAULT_SPARE,
    P90_RATIO_TARGET,
    _check,
    _ms,
    _pool_counts,
    _script,
    _sf_burst,
)

LONG_IDLE_S = 600.0
LONG_IDLE_BURST = 32


class LongIdle:
    """A daemon (and its own emulator) started when the bench starts, served
    one call, then left idle until `burst`: its pool at its floor."""

    def __init__(self, idle_s: float = LONG_IDLE_S) -> None:
        self.idle_s = idle_s
        self._stack = contextlib.ExitStack()
        self.emu = self._stack.enter_context(emulator())
        self.proc = self._stack.enter_context(daemon(
            providers_for(self.emu, stale_timeout_s=120.0),
            {"workers_max": 64, "queue_max": 1000, "workers_spare": DEFAULT_SPARE},
            ready_timeout=180.0))
        _sf_burst(self.proc, _script(self.emu.client(), 1, 4, realistic_text(4)))
        self.idle_since = time.monotonic()

    def burst(self, n: int, chunks: int, text: str) -> dict[str, Any]:
        """Wait out the rest of `idle_s`, then one burst of `n` (as `_sf_run`)."""
        left = self.idle_since + self.idle_s - time.monotonic()
        if left > 0:
            log(f"  ttft: the long-idle daemon is idle {self.idle_s - left:.0f} s; "
                f"waiting {left:.0f} s more")
            time.sleep(left)
        control = self.emu.client()
        before = _pool_counts(self.proc)
        since = int(control.health()["requests"])
        calls = _script(control, n, chunks, text)
        _sf_burst(self.proc, calls)
        after = _pool_counts(self.proc)
        started = dict(self.proc.journal_rows("SELECT call_id, started FROM attempts "
                                              "WHERE attempt = 1"))
        at_emu = {r["key"]: r["started"] for r in control.log(since=since)}
        parts = [(started[c.call_id] - c.w0, at_emu[c.key] - started[c.call_id],
                  c.wfirst - at_emu[c.key])
                 for c in calls if c.first and c.call_id in started and c.key in at_emu]
        return {"calls": calls, "parts": parts, "idle_before": before["workers"],
                "forks": after["spawned_total"] - before["spawned_total"],
                "workers_after": after["workers"], "idle_s": time.monotonic() - self.idle_since}

    def close(self) -> None:
        self._stack.close()

    def run(self, sec: Section, chunks_by_burst: dict[int, int],
            results: dict[int, dict[str, list[dict[str, Any]]]]) -> None:
        """The burst, checked and reported in `sec` beside the SDK's results
        of the same burst size (`results`, as `ttft.run` keeps them)."""
        n = LONG_IDLE_BURST
        chunks = chunks_by_burst.get(n, 20)
        text = realistic_text(chunks)
        res = self.burst(n, chunks, text)
        res["ttft"] = _check("streamfence (idle 10 min)", res, text)
        _report(sec, n, res, results.get(n, {}).get("openai-sdk", []))


def _report(sec: Section, n: int, res: dict[str, Any],
                      sdk: list[dict[str, Any]]) -> None:
    ttft = res["ttft"]
    p50, p90 = percentile(ttft, 50), percentile(ttft, 90)
    sec.row(f"burst {n} on a daemon idle {res['idle_s'] / 60:.0f} min: streamfence",
            f"p50 {_ms(p50)} ms, p90 {_ms(p90)} ms")
    if not sdk:
        return
    pooled = sorted(t for r in sdk for t in r["ttft"])
    added = p50 - percentile(pooled, 50)
    ratio = p90 / percentile(pooled, 90)
    sec.row(f"burst {n}, idle {res['idle_s'] / 60:.0f} min: added p50 (streamfence − SDK)",
            f"{added * 1e3:+.1f} ms", f"≤ {ADDED_P50_TARGET_S * 1e3:.0f} ms", "",
            added <= ADDED_P50_TARGET_S)
    sec.row(f"burst {n}, idle {res['idle_s'] / 60:.0f} min: p90 streamfence ÷ SDK",
            f"{ratio:.2f}", f"≤ {P90_RATIO_TARGET}", "", ratio <= P90_RATIO_TARGET)
    split = ", ".join(
        f"{name} p50 {_ms(median([x[i] for x in res['parts']]))} ms"
        for i, name in enumerate(("submit → attempt scheduled",
                                  "scheduled → request at the emulator",
                                  "request → first delta at the subscriber")))
    sec.note(f"- burst {n} on the daemon idle {res['idle_s']:.0f} s (one sample of {n} calls, "
             f"against the SDK's burst {n} of this section): workers before "
             f"{res['idle_before']}, forks during the burst {res['forks']}, workers after "
             f"{res['workers_after']}. split: {split}.")
