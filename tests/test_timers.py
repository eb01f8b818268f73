"""Event-driven timing (docs/ARCHITECTURE.md §4.12): deadlines in a heap, and
an idle daemon whose processes sleep instead of ticking."""

from __future__ import annotations

import glob
import time
from typing import Any

import psutil

from streamfence.supervisor.timers import Deadlines
from tests.harness import DaemonProcess, wait_until


def test_deadlines_pop_in_order_and_rearming_replaces() -> None:
    due: Deadlines[str] = Deadlines()
    assert due.next_due() is None and due.pop_due(1e9) == []
    due.arm("a", 5.0)
    due.arm("b", 2.0)
    due.arm("c", 9.0)
    due.arm("a", 1.0)  # re-armed earlier: the 5.0 entry is a leftover
    due.arm("c", 3.0)
    due.clear("b")
    assert due.next_due() == 1.0 and len(due) == 2
    assert due.pop_due(0.5) == []
    assert due.pop_due(4.0) == ["a", "c"]
    assert due.next_due() is None and due.pop_due(100.0) == []  # leftovers never fire


def test_deadlines_same_time_rearm_fires_once_and_heap_stays_bounded() -> None:
    due: Deadlines[int] = Deadlines()
    for _ in range(3):
        due.arm(7, 1.0)
    assert due.pop_due(1.0) == [7]
    for i in range(10_000):  # one key re-armed over and over: leftovers are compacted
        due.arm(1, float(i))
    assert len(due._heap) <= 2 * len(due) + 65
    assert due.pop_due(1e9) == [1]


def _wakeups(pids: list[int]) -> dict[str, int]:
    """Times each thread of `pids` was scheduled so far (schedstat's third field)."""
    counts: dict[str, int] = {}
    for pid in pids:
        for task in glob.glob(f"/proc/{pid}/task/*"):
            try:
                with open(f"{task}/schedstat") as f:
                    counts[task] = int(f.read().split()[2])
            except (OSError, ValueError, IndexError):
                continue
    return counts


def test_an_idle_daemon_sleeps(make_daemon: Any) -> None:
    """No client, no call: no process of the daemon wakes on a timer. (With the
    old 20 ms tick the supervisor alone woke ~150 times in 3 s; the sink's
    checkpointer 12 times.)"""
    daemon: DaemonProcess = make_daemon()
    with daemon.client() as client:
        wait_until(lambda: sum(w["state"] == "idle" for w in client.status()["workers"]) >= 2,
                   30, "two idle workers")
    assert daemon.proc is not None
    root = psutil.Process(daemon.proc.pid)
    pids = [root.pid] + [c.pid for c in root.children(recursive=True)]
    # Start-up work ends on its own (the spares' warm-ups, the status
    # exchange above): look at successive 3 s windows until one is quiet. A
    # daemon that wakes on a timer is never quiet.
    deadline = time.monotonic() + 30.0
    while True:
        before = _wakeups(pids)
        time.sleep(3.0)  # the observation window
        after = _wakeups(pids)
        woke = {task: after[task] - before[task] for task in before if task in after
                and after[task] > before[task]}
        if sum(woke.values()) <= 6:
            return
        assert time.monotonic() < deadline, f"an idle daemon keeps waking up: {woke}"
