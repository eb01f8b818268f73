"""The arithmetic of scripts/bench_ab_cluster.py's table: B/A is the median of
per-round ratios (each round's A paired with that round's B), with their
spread. Made-up figures, no run, no timing: the run belongs to the script."""

from __future__ import annotations

from typing import Any

from scripts.bench.common import ratio_spread
from scripts.bench_ab_cluster import table


def _round(ttft_s: float, cpu_s: float, rate: float) -> dict[str, Any]:
    return {"ttft": [ttft_s, ttft_s / 2, ttft_s * 2], "daemon": cpu_s / 2, "nats": cpu_s / 2,
            "rate": rate}


def test_ratios_pair_rounds_before_the_median() -> None:
    # Sorted apart, a and b would give ratios of 1; paired by round they differ.
    assert ratio_spread([1.0, 2.0, 4.0], [2.0, 2.0, 2.0]) == (1.0, 0.5, 2.0)


def test_table_shows_medians_and_ratio_spread() -> None:
    a = [_round(0.010, 100e-6, 1000.0), _round(0.020, 200e-6, 2000.0)]
    b = [_round(0.010, 300e-6, 500.0), _round(0.040, 200e-6, 2000.0)]
    res = {level: {"A": a, "B": b} for level in ("1", "32", "rate")}
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in table(res)[2:]}
    assert rows["1 stream: TTFT p50 (ms)"] == ["15.0", "25.0", "1.500", "1.000 .. 2.000 |"]
    assert rows["32 streams: CPU/delta, daemon + NATS (µs)"] == [
        "150.0", "250.0", "2.000", "1.000 .. 3.000 |"]
    assert rows["32 unpaced: deltas/s (higher is better)"] == [
        "1,500.0", "1,250.0", "0.750", "0.500 .. 1.000 |"]
