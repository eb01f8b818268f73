"""Smoke test of the benchmark suite (scripts/bench): its smallest
configuration runs end to end and prints the table. No assertion on any
figure: timing belongs to `python -m scripts.bench`, not to the test suite."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.serial
def test_bench_quick_smoke() -> None:
    # The sink + producers (throughput) and the real daemon + emulator
    # (failover): the two kinds of set-up every section is built from; and
    # latency, whose paths include a local client's events link.
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench", "--quick", "--rounds", "1",
         "--only", "throughput", "failover", "latency"],
        cwd=ROOT, capture_output=True, text=True, timeout=100,
        env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| section | measure | result | target | verdict |" in proc.stdout
    assert "2 sink throughput" in proc.stdout
    assert "4 failover" in proc.stdout
    assert "→ a local client's link @ 20k/s" in proc.stdout
    assert "section failed" not in proc.stdout
