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
    """Issue 13: a kill storm on the sink, the sink frozen past the stale
    timeout, the state dir's disk full, another process's lock on each
    database, one after another against one daemon under load: every call
    completes exactly, from one provider request, and the supervisor stays up."""
    proc = subprocess.run([sys.executable, "-m", "scripts.chaos_storage", "--seed", "15",
                           "--calls", "400", "--duration", "24", "--storm", "2", "--in-turn"],
                          capture_output=True, text=True, timeout=220)
    report = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0, report
    assert "every call exact from one request): PASS" in proc.stdout, report
    assert "the supervisor stayed up: yes" in proc.stdout, report
    injected = {line.split("injected: ", 1)[1].rsplit(" = ", 1)[0]: int(line.rsplit("=", 1)[1])
                for line in proc.stdout.splitlines() if "injected: " in line}
    assert injected.get("sink SIGKILLs", 0) >= 2, report
    for fault in ("sink frozen (SIGSTOP)", "journal.db locked", "transcript.db locked"):
        assert any(what.startswith(fault) for what in injected), report
    # Where no tmpfs can be mounted the script says so; here (root) it must run.
    assert any(what.startswith("disk full") for what in injected) or \
        "full: SKIPPED" in proc.stdout, report


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


@pytest.mark.timeout(300)
def test_chaos_cluster_hosts_and_nodes_die_and_no_call_is_lost() -> None:
    """Issue 16: three hosts on a 3-node NATS cluster under load; a host killed
    (kill -9 of its tree) and restarted, a host frozen past its lease (a zombie)
    and woken, a NATS node killed and restarted: every accepted call ends with
    one answer in its log (0 lost, 0 interleaved, 0 duplicated, 0 superseded),
    a subscriber of any host sees the log, no provider request is left open."""
    proc = subprocess.run([sys.executable, "-m", "scripts.chaos_cluster", "--seed", "17",
                           "--duration", "16", "--storm", "1.5", "--lease", "1.5",
                           "--concurrency", "12"],
                          capture_output=True, text=True, timeout=280)
    report = proc.stdout + proc.stderr[-3000:]
    assert "every fault injected: yes" in proc.stdout, report
    assert "verdict: PASS" in proc.stdout, report
    assert proc.returncode == 0, report


@pytest.mark.timeout(120)
def test_chaos_schedules_inject_faults_between_steps_and_judge_them() -> None:
    """Issue 28: three schedules of the explorer (one per pair class), fixed
    seed: the armed failpoints fired as planned (their passes are in the
    hits), and the judge found 0 violations. Seed 67's three: a worker's
    crash before its final, then a crash of the sink as it authorizes the
    retry; a SIGKILL of the sink then a pause of a worker at its rebind
    (free: each call one provider request); a SIGKILL of the sink, a pause
    before the rebind, a crash of the new sink at it (free). Each mix holds
    an HTTP resume from an earlier id."""
    proc = subprocess.run([sys.executable, "-m", "scripts.chaos_schedules", "--seed", "67",
                           "--schedules", "3"],
                          capture_output=True, text=True, timeout=110)
    report = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0, report
    assert "verdict: PASS" in proc.stdout and "violations: 0" in proc.stdout, report
    assert "faults fired as planned: 3/3" in proc.stdout, report
    hits = [line for line in proc.stdout.splitlines() if line.startswith("points passed")]
    assert hits and hits[0] != "points passed (armed): {}", report



@pytest.mark.timeout(120)
def test_chaos_schedules_on_a_cluster_host() -> None:
    """`--cluster`: the explorer's daemon as one host of a NATS cluster of its
    own. Seed 11111's schedule 6 crashes the supervisor after a submit's
    journal commit, before the cluster has the call's record: its restart
    stores the call again before it runs (3 of the 6 calls were lost before
    that fix: docs/GUARANTEES.md, "Faults between steps")."""
    proc = subprocess.run([sys.executable, "-m", "scripts.chaos_schedules", "--cluster",
                           "--only", "crash", "--seed", "11111", "--index", "6"],
                          capture_output=True, text=True, timeout=110)
    report = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0, report
    assert "supervisor.after_journal_commit=crash' (a cluster host)" in proc.stdout, report
    assert "faults fired as planned: 1/1" in proc.stdout, report
    assert "verdict: PASS" in proc.stdout and "violations: 0" in proc.stdout, report
