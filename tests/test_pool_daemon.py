"""The pool's policy in a real daemon (real zygote, workers, emulator),
synchronized on `status` counts and the journal, never on time: a burst
grows the pool and it shrinks back to `workers_spare` once idle; the spares
that refill it wait while the burst's attempts start (forks for waiting
calls go at once); a retry after a stalled attempt runs on a spare that
was ready before the kill; a spare warms up at its own priority and gives
way to an attempt."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

from streamfence.devtools.emulator.control import EmulatorClient
from streamfence.devtools.launcher import DaemonProcess
from streamfence.protocol import failpoints
from streamfence.protocol.client import Client
from tests.harness import wait_until
from tests.wires import request_for


def _status(client: Client) -> dict[str, Any]:
    return client.status()


def _workers(client: Client, *states: str) -> list[dict[str, Any]]:
    return [w for w in client.status()["workers"] if not states or w["state"] in states]


def _submit(client: Client, emu: EmulatorClient, steps: list[dict[str, Any]],
            **options: Any) -> str:
    key = f"pool-{uuid.uuid4().hex[:10]}"
    emu.script(key, steps)
    return str(client.submit("emu", request_for("openai", key), options=options or None))


def _done(client: Client, call_id: str) -> dict[str, Any]:
    for event in client.events(call_id, timeout_s=60.0):
        if event["op"] == "done":
            return event
    raise AssertionError(f"no done for {call_id}")


def test_a_burst_grows_the_pool_and_it_shrinks_back_to_its_spares(
        make_daemon: Any, emu: EmulatorClient) -> None:
    proc: DaemonProcess = make_daemon(daemon={"workers_spare": 2, "workers_max": 16,
                                              "workers_peak_half_life_s": 0.5})
    with proc.client(timeout_s=30.0) as client:
        wait_until(lambda: len(_workers(client, "idle")) == 2, 60.0, "the 2 spares")
        steps = [{"fault": "ok", "chunks": 30, "chunk_delay_s": 0.05}]
        calls = [_submit(client, emu, steps) for _ in range(6)]
        wait_until(lambda: len(_workers(client, "busy")) == 6, 60.0, "6 busy workers")
        for call_id in calls:
            assert _done(client, call_id)["status"] == "completed"
        pool = _status(client)["pool"]
        assert pool["spawned_total"] >= 6, pool
        wait_until(lambda: len(_workers(client)) == 2
                   and len(_workers(client, "idle")) == 2, 60.0,
                   "the pool back to its 2 spares")
        assert _status(client)["pool"]["retired_total"] >= 4


def test_spare_forks_wait_while_a_bursts_attempts_start(
        make_daemon: Any, emu: EmulatorClient) -> None:
    # The burst's first chunks never come while the test looks (a long
    # silence first), and the spares' wait is longer than the test.
    proc: DaemonProcess = make_daemon(daemon={"workers_spare": 2, "workers_max": 16,
                                              "workers_refill_wait_s": 600.0})
    with proc.client(timeout_s=30.0) as client:
        wait_until(lambda: len(_workers(client, "idle")) == 2, 60.0, "the 2 spares")
        before = _status(client)["pool"]
        steps = [{"fault": "stall", "after": 0, "stall_s": 120.0, "chunks": 2}]
        calls = [_submit(client, emu, steps) for _ in range(5)]
        wait_until(lambda: len(_workers(client, "busy")) == 5, 60.0, "5 busy workers")
        pool = _status(client)["pool"]
        # The 2 spares ran 2 calls; the 3 others got their forks at once;
        # the 2 spares that would refill the pool wait.
        assert pool["spawned_total"] - before["spawned_total"] == 3, pool
        assert pool["refills_deferred"] > before["refills_deferred"]
        assert len(_workers(client)) == 5
        for call_id in calls:
            client.cancel(call_id)
        # Nothing is starting any more: the spares are forked.
        wait_until(lambda: len(_workers(client, "idle")) >= 2, 60.0, "the spares refilled")


def test_a_retry_runs_on_a_spare_ready_before_the_kill(
        make_daemon: Any, emu: EmulatorClient) -> None:
    proc: DaemonProcess = make_daemon(
        profile={"stale_timeout_s": 0.5},
        daemon={"workers_spare": 2, "backoff_base_s": 0.0, "backoff_max_s": 0.0})
    with proc.client(timeout_s=30.0) as client:
        wait_until(lambda: len(_workers(client, "idle")) == 2, 60.0, "the 2 spares")
        call_id = _submit(client, emu, [{"fault": "stall", "after": 3, "chunks": 10,
                                         "stall_s": 30.0}, {"fault": "ok", "chunks": 10}],
                          on_partial="restart")
        ready: set[int] = set()
        done: dict[str, Any] = {}
        for event in client.events(call_id, timeout_s=60.0):
            if event["op"] == "delta" and not ready:
                ready = {w["pid"] for w in _workers(client, "idle")}
            if event["op"] == "done":
                done = event
                break
        assert done["status"] == "completed" and done["attempts"] == 2, done
        rows = dict(proc.journal_rows("SELECT attempt, worker_pid FROM attempts WHERE call_id = ?",
                                      call_id))
        assert rows[2] in ready, f"the retry ran on pid {rows[2]}, not a spare ({ready})"


WARM_UP_STEP = "worker.before_warm_up_step"
WARM_UP_PAUSE_S = 4.0


def _passes(where: Path, point: str) -> list[int]:
    """The pids that passed `point`, once per pass (failpoints' record)."""
    try:
        lines = (where / "hits").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [int(pid) for name, pid in (line.split() for line in lines) if name == point]


def test_a_spare_warms_up_at_its_own_priority_and_gives_way_to_an_attempt(
        make_daemon: Any, emu: EmulatorClient, tmp_path: Path) -> None:
    """A spare's warm-up runs at the worker's own priority, and between its
    steps looks for an attempt: one that came meanwhile ends it. Why: the
    warm-up ran on a thread at nice 19 beside the attempt, and on a busy
    machine the kernel leaves such a thread waiting for a core while it
    holds the GIL: the attempt stands still with it (0.6-1.7 s in a probe,
    docs/PERFORMANCE.md "A spare's warm-up and the GIL"). Held at its first
    step (a failpoint's pause), the spare is given a call."""
    where = tmp_path / "failpoints"
    where.mkdir()
    proc: DaemonProcess = make_daemon(
        daemon={"workers_spare": 1},
        env={failpoints.ENV: f"{WARM_UP_STEP}=pause({WARM_UP_PAUSE_S:g}s)",
             failpoints.DIR_ENV: str(where)})
    with proc.client(timeout_s=30.0) as client:
        pids = wait_until(lambda: _passes(where, WARM_UP_STEP), 60.0,
                          "the spare to reach its warm-up")
        held_since = time.monotonic()
        pid = pids[0]
        own = os.getpriority(os.PRIO_PROCESS, pid)
        threads = {int(tid): os.getpriority(os.PRIO_PROCESS, int(tid))
                   for tid in os.listdir(f"/proc/{pid}/task")}
        assert set(threads.values()) == {own}, \
            f"a thread of the warming spare {pid} runs at another priority: {threads} (own {own})"
        call_id = _submit(client, emu, [{"fault": "ok", "chunks": 3}])
        wait_until(lambda: any(w["pid"] == pid and w["call_id"] == call_id
                               for w in _workers(client)), 30.0, "the call given to the spare")
        assert time.monotonic() - held_since < WARM_UP_PAUSE_S, \
            "the call reached the spare after its warm-up's pause: this test proves nothing"
        done = _done(client, call_id)
        assert done["status"] == "completed" and done["attempts"] == 1, done
        assert _passes(where, WARM_UP_STEP).count(pid) == 1, \
            f"the spare {pid} went on warming up after its attempt came: {_passes(where, WARM_UP_STEP)}"
