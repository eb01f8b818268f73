"""Short runs of the chaos scripts (the CI version of issue 5's chaos runs):
each must end with a PASS verdict: 0 lost, 0 interleaved, 0 duplicated,
0 superseded, every failure with a clear error. Fixed seeds, bounded."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

RUNS = {
    # Short on purpose (CI's 15 minutes): each still injects its fault many times
    # (chaos_daemon: twice); the 60 s runs are in the issues' notes.
    "chaos_workers": ["--seed", "11", "--calls", "300", "--duration", "12", "--kill-every", "0.3"],
    "chaos_daemon": ["--seed", "12", "--calls", "300", "--duration", "15",
                     "--restart-every", "6"],
    "chaos_input": ["--seed", "13", "--calls", "300", "--duration", "8"],
}
# The fault each run must really have injected (the line its verdict prints).
INJECTED = {"chaos_workers": "worker SIGKILLs", "chaos_daemon": "daemon SIGKILL + restart",
            "chaos_input": "forged frames to the sink's worker socket"}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("script", sorted(RUNS))
def test_chaos_script_passes(script: str) -> None:
    proc = subprocess.run([sys.executable, "-m", f"scripts.{script}", *RUNS[script]],
                          capture_output=True, text=True, timeout=220)
    report = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0, report
    assert "verdict: PASS" in proc.stdout, report
    assert "lost (must be 0)" in proc.stdout
    injected = [line for line in proc.stdout.splitlines() if INJECTED[script] in line]
    assert injected and int(injected[0].rsplit("=", 1)[1]) > 0, report
