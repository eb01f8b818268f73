"""Short runs of the chaos scripts (the CI version of issue 5's chaos runs):
each must end with a PASS verdict: 0 lost, 0 interleaved, 0 duplicated,
0 superseded, every failure with a clear error. Fixed seeds, bounded."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.serial]

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


# chaos_clients: the verdict's lines that must say ok (its latency lines are
# printed, not asserted here: issue 12's p99 bound is not met on a loaded
# 2-core runner yet; the 60 s runs' figures are in docs/PERFORMANCE.md).
CLIENTS_OK = ("peak RSS of the supervisor", "peak RSS of the sink", "peak RSS of the zygote",
              "peak RSS of the worker", "slow readers", "SIGTERM during the storm",
              "the storm happened", "the sink never restarted")


@pytest.mark.timeout(240)
def test_chaos_clients_storm_happens_and_calls_stay_exact() -> None:
    proc = subprocess.run([sys.executable, "-m", "scripts.chaos_clients", "--seed", "14",
                           "--calls", "200", "--duration", "6", "--replay-deltas", "10000"],
                          capture_output=True, text=True, timeout=220)
    report = proc.stdout + proc.stderr[-3000:]
    assert "verdict: PASS" in proc.stdout, report
    lines = proc.stdout.splitlines()
    for what in CLIENTS_OK:
        assert any(line.strip().startswith(f"ok   {what}") for line in lines), report
    assert any("latency of a well-behaved client" in line for line in lines), report


@pytest.mark.timeout(240)
def test_chaos_storage_every_call_exact_from_one_request() -> None:
    """Issue 13: a kill storm on the sink and a sink frozen past the stale
    timeout; every call completes exactly, from one provider request."""
    proc = subprocess.run([sys.executable, "-m", "scripts.chaos_storage", "--seed", "15",
                           "--calls", "200", "--duration", "6", "--storm", "3"],
                          capture_output=True, text=True, timeout=220)
    report = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0, report
    for fault in ("kills", "freeze"):
        assert f"verdict ({fault}, every call exact from one request): PASS" in proc.stdout, report
    kills = [line for line in proc.stdout.splitlines() if "sink SIGKILLs" in line]
    assert kills and int(kills[0].rsplit("=", 1)[1]) >= 2, report


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
