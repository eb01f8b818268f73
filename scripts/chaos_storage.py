"""Chaos: storage and sink faults under a load of streaming calls (issue 13).

    python -m scripts.chaos_storage [--seed N] [--duration 10] [--only kills,freeze]

Each fault runs against a daemon of its own, beside a load of concurrent
calls whose provider (the emulator) never fails:

- kills:  SIGKILL of the sink, about 3 a second for `--storm` seconds
          (the supervisor restarts it with back-off and rebinds every
          attempt in flight: docs/ARCHITECTURE.md §2.8);
- freeze: SIGSTOP of the sink for longer than the stale timeout, while the
          provider sends the rest of the answers (§4.1: the sink's time is
          not the provider's stall);
- full:   the state dir on a small tmpfs, filled up for `--storm` seconds
          and freed (skipped, saying why, where no tmpfs can be mounted):
          submits meanwhile get `storage_full` (the load submits again, with
          the same idempotency key), running calls pause and go on;
- lock-journal, lock-transcript: another process's write transaction
          (BEGIN IMMEDIATE, as a backup tool or a `sqlite3` shell holds)
          on that file for `--storm` seconds.

With `--in-turn`, the faults come one after another against one daemon and
one load (what CI runs: a daemon that survives each fault must survive the
next). Verdict per run: 0 lost, duplicated, interleaved, superseded (the common
judge: the transcript as subscribers saw it against the emulator's record),
and every call `completed` with the exact text from one provider request
(the emulator's log has one request per call).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sqlite3
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scripts.chaos_common import (
    ChaosState,
    NoSmallDisk,
    chaos_run,
    parser,
    run_load,
    seeded,
    verdict,
)
from streamfence.devtools import disks

STALE_S = 2.0  # the profile's stale timeout in these runs


def steps(rng: random.Random) -> list[dict[str, Any]]:
    return [{"fault": "ok", "chunks": rng.randint(20, 60),
             "chunk_delay_s": rng.uniform(0.01, 0.04)}]


def options(rng: random.Random) -> dict[str, Any]:
    return {"on_partial": rng.choice(["continue", "restart"])}


def _sink_pid(state: ChaosState) -> int | None:
    with state.daemon.client(timeout_s=5.0) as client:
        pid = client.status()["processes"]["sink"]
    return pid if isinstance(pid, int) else None


def kill_storm(state: ChaosState, rng: random.Random, start_s: float, storm_s: float) -> None:
    """SIGKILL the sink about 3 times a second for `storm_s` seconds."""
    if state.stop.wait(start_s):
        return
    end = time.monotonic() + storm_s
    while time.monotonic() < end and not state.stop.wait(rng.uniform(0.2, 0.45)):
        try:
            pid = _sink_pid(state)
            if pid is not None:  # None: down, awaiting its restart
                os.kill(pid, signal.SIGKILL)
                state.count("sink SIGKILLs")
        except (TimeoutError, ProcessLookupError):
            continue


def freeze(state: ChaosState, rng: random.Random, start_s: float, storm_s: float) -> None:
    """SIGSTOP the sink for the stale timeout and then some, once."""
    if state.stop.wait(start_s):
        return
    pid = _sink_pid(state)
    if pid is None:
        return
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(STALE_S + max(2.0, storm_s))  # the fault itself: frozen this long
        state.count(f"sink frozen (SIGSTOP) for {STALE_S + max(2.0, storm_s):.0f} s "
                    f"(stale timeout {STALE_S:g} s)")
    finally:
        os.kill(pid, signal.SIGCONT)


def full_disk(state: ChaosState, rng: random.Random, start_s: float, storm_s: float) -> None:
    """Fill the state dir's disk for `storm_s` seconds, once."""
    if state.stop.wait(start_s):
        return
    filler = disks.fill(state.daemon.state_dir)
    try:
        state.stop.wait(storm_s)  # the fault itself: the disk full this long
        state.count(f"disk full for {storm_s:g} s")
    finally:
        filler.unlink()


def _lock(file: str) -> Callable[[ChaosState, random.Random, float, float], None]:
    def lock(state: ChaosState, rng: random.Random, start_s: float, storm_s: float) -> None:
        """Hold a write transaction on `file` for `storm_s` seconds, once."""
        if state.stop.wait(start_s):
            return
        other = sqlite3.connect(state.daemon.state_dir / file, isolation_level=None,
                                timeout=30.0)
        try:
            other.execute("BEGIN IMMEDIATE")
            state.stop.wait(storm_s)  # the fault itself: the lock held this long
            state.count(f"{file} locked by another process for {storm_s:g} s")
            other.execute("ROLLBACK")
        finally:
            other.close()
    return lock


FAULTS: dict[str, Callable[[ChaosState, random.Random, float, float], None]] = {
    "kills": kill_storm, "freeze": freeze, "full": full_disk,
    "lock-journal": _lock("journal.db"), "lock-transcript": _lock("transcript.db")}
DISK_MIB = 64  # the `full` fault's tmpfs


Inject = Callable[[ChaosState, random.Random, float, float], None]


def _no_small_disk() -> str | None:
    """Why no tmpfs can be mounted here, or None."""
    with tempfile.TemporaryDirectory() as tmp, disks.small_disk(Path(tmp) / "probe", 1) as why:
        return why


def run_faults(names: list[str], args: argparse.Namespace, rng: random.Random) -> bool:
    """The faults `names`, one after another, against one daemon and one load."""
    def in_turn(state: ChaosState, rng: random.Random, start_s: float, storm_s: float) -> None:
        for name in names:
            FAULTS[name](state, rng, start_s, storm_s)
    title = "+".join(names)
    try:
        with chaos_run({"workers_max": args.workers_max}, {"stale_timeout_s": STALE_S},
                       state_disk=DISK_MIB if "full" in names else None) as state:
            return _run(title, in_turn, state, args, rng, sink_may_restart="kills" in names)
    except NoSmallDisk as exc:
        if names != ["full"]:
            raise
        print(f"chaos_storage: full: SKIPPED: {exc}\n")
        return True


def _run(name: str, inject: Inject, state: ChaosState, args: argparse.Namespace,
         rng: random.Random, sink_may_restart: bool) -> bool:
    t = threading.Thread(target=inject, args=(state, random.Random(rng.random()),
                                              min(2.0, args.duration / 4), args.storm),
                         daemon=True)
    t.start()
    run_load(state, args, rng, steps, options)
    t.join(timeout=60)
    with state.daemon.client(timeout_s=5.0) as client:
        counters = client.status()["counters"]
    state.count("sink restarts seen by the supervisor", counters.get("sink_restarts", 0))
    state.count("attempts rebound", counters.get("attempts_rebound", 0))
    for code in ("storage_full", "storage_busy", "storage_error"):
        if counters.get(f"refused.{code}"):
            state.count(f"submits refused with {code} (submitted again)",
                        counters[f"refused.{code}"])
    proc = state.daemon.proc
    up = proc is not None and proc.poll() is None
    # Only the kill storm may restart the sink; no fault may stop the supervisor.
    sink_kept = sink_may_restart or counters.get("sink_restarts", 0) == 0
    ok = verdict(state, f"chaos_storage: {name}")
    exact = one_request = 0
    for record in state.records:
        sent = state.emu.log(record.key)
        done = record.done or {}
        content = (done.get("response") or {}).get("content")
        if done.get("status") == "completed" and len(sent) == 1 \
                and content == sent[0].get("text"):
            exact += 1
        one_request += len(sent) == 1
    calls = len(state.records)
    print(f"  completed with the exact text: {exact} of {calls}; "
          f"one provider request: {one_request} of {calls}")
    # What each process said of the fault (the journal's and the sink's own lines).
    said = [line.split(": ", 1)[-1][:150] for line in state.daemon.log_text().splitlines()
            if ("cannot write" in line or "writable again" in line or "is full" in line
                or "is locked" in line)]
    for line in said[:6]:
        print(f"  logged: {line}")
    print(f"  the supervisor stayed up: {'yes' if up else 'NO'}"
          + ("" if sink_may_restart else
             f"; the sink never restarted: {'yes' if sink_kept else 'NO'}"))
    good = ok and calls > 0 and exact == calls == one_request and up and sink_kept
    print(f"  verdict ({name}, every call exact from one request): "
          f"{'PASS' if good else 'FAIL'}\n")
    return good


def main() -> int:
    p = parser(__doc__.split("\n\n")[0], calls=400, duration=10.0)
    p.add_argument("--storm", type=float, default=5.0,
                   help="seconds of the kill storm (the freeze lasts the stale timeout + this)")
    p.add_argument("--only", default=",".join(FAULTS), help="faults to run, comma separated")
    p.add_argument("--in-turn", action="store_true",
                   help="one daemon and one load for all the faults, one after another "
                        "(make --duration long enough for all of them)")
    args = p.parse_args()
    args.concurrency = min(args.concurrency, 20)
    rng = seeded(args)
    names = [name for name in args.only.split(",") if name]
    unknown = sorted(set(names) - set(FAULTS))
    if unknown:
        p.error(f"unknown faults {unknown}; known: {', '.join(FAULTS)}")
    if args.in_turn:
        if "full" in names and (reason := _no_small_disk()):
            print(f"chaos_storage: full: SKIPPED: {reason}\n")
            names.remove("full")
        results = [run_faults(names, args, rng)]
    else:
        results = [run_faults([name], args, rng) for name in names]
    return 0 if results and all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
