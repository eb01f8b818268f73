"""The schedule explorer: faults in the windows between steps (issue 28).

    python -m scripts.chaos_schedules [--schedules 200] [--seed S] [--only CLASS]
                                      [--index K] [--list] [--cluster]

A schedule arms one or two failpoints (streamfence/protocol/failpoints.py,
docs/ARCHITECTURE.md §7) through STREAMFENCE_FAILPOINTS, runs a mix of six
calls against a fresh daemon (its own state dir, its own
STREAMFENCE_FAILPOINTS_DIR) and the emulator, and judges it. Classes:

    crash+crash   a crash at P1, then a crash at P2, a step of the recovery from P1
    crash+pause   a crash at P1, then a pause at P2 in the recovery from P1
    pause+crash   a pause at a check, a crash at the act that depends on it
    crash         one crash
    pause         one pause (shorter than the stale timeout)
    host-pause    (with --only only) two hosts on a NATS cluster, one standing
                  still past its lease at a cluster.* point: scripts/chaos_host_pause.py

With `--cluster` each schedule's daemon is one host of a cluster (a real
3-node NATS cluster of its own, started per schedule), and a single fault
may also be armed at the `cluster.*` points (never counted free): the same
faults, now with the cluster's replication and ownership between the steps.

P1 may also be a SIGKILL of the sink from outside at a time into the run.
A recovery step is one that only the recovery passes (after a sink's death:
the rebind), or, when P1 kills the supervisor (the whole daemon: its
children die with it), any step of the restarted daemon: this script
restarts it, armed with P2 only (printed as "then, after the restart").
The call mix: ZeroMQ calls on the three wires (openai, anthropic, bedrock
profiles) under `continue` and `restart`, one that resubscribes from an
earlier seq, one that is cancelled, and two HTTP calls through the gateway
(Idempotency-Key; on a dropped connection they re-POST with Last-Event-ID),
one of which reconnects on purpose naming an earlier id.

The judge reads the emulator's record and the subscribers' view, never the
daemon's counters: each call reaches a done (else `lost`), is not
`duplicated`, `interleaved` or `superseded` (streamfence.devtools.verdict),
a subscriber misses no event (`skipped`: a gap in the seqs, or an HTTP
stream whose text is not the call's answer), every provider request is
closed at the end (`open_request`), no process outlives the daemon
(`survivor`), and, where every fault of the schedule is free by design,
no call costs a second provider request (`extra_request`), no HTTP stream
ends in an error (`http_error`) and no subscriber waits over STALL_S for
its next event (`stalled`):

    fault                               free  why
    crash of the sink (sink.*, SIGKILL)  yes   the sink restarts; running attempts are
                                               rebound to a new epoch (§2.8, §4.14)
    crash of the gateway                 yes   it restarts; HTTP clients resume by
                                               Idempotency-Key + Last-Event-ID
    a pause anywhere (< stale timeout)   yes   nothing times out: the stream goes on
    crash of the supervisor              no    the daemon dies with its children; on
                                               restart recovery runs unfinished calls
                                               again (§4.10): a second request each
    crash of a worker                    no    the attempt dies: the call is retried
                                               (§4.3) or ends partial (§4.4)

Output: one line per schedule, a table per class, the seed, and for each
failing schedule its STREAMFENCE_FAILPOINTS string(s) and call mix;
`--index K` (with the same seed and --only) runs schedule K alone. Exit 1
on any violation.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scripts import chaos_host_pause as host_pause
from scripts.chaos_calls import (
    HTTP_READ_S,
    Followed,
    Plan,
    follow_http,
    follow_zmq,
    judge_call,
    transcript,
)
from streamfence.devtools.emulator.control import (
    EmulatorClient,
    EmulatorProcess,
    emulator_profile,
)
from streamfence.devtools.launcher import DaemonExited, DaemonProcess
from streamfence.devtools.nats_cluster import nats_cluster
from streamfence.devtools.verdict import CallRecord
from streamfence.protocol import failpoints
from streamfence.protocol.client import ClientError
from streamfence.protocol.wires import WIRES

CLASSES = ("crash+crash", "crash+pause", "pause+crash", "crash", "pause")
STALE_S = 6.0  # the profiles' stale timeout: every pause is shorter
CALL_DEADLINE_S = 45.0  # a call not done this long after the schedule's start is lost
# A subscriber waiting longer than this for its next event is reported, and is a
# violation in a free schedule (a daemon restart takes ~10 s here; HTTP_READ_S: how
# long an HTTP client of this script waits before it re-POSTs).
STALL_S = 12.0
assert STALL_S < HTTP_READ_S
SINK_KILL = "SIGKILL of the sink"  # P1 from outside (not a failpoint)

# Points passed only while recovering from a sink's death (P2 after a sink P1).
AFTER_SINK = ("supervisor.before_rebind", "sink.after_rebind", "worker.after_rebind")
# Steps a restarted daemon passes while it runs the unfinished calls again.
AFTER_SUPERVISOR = ("supervisor.before_authorize", "sink.after_authorize",
                    "supervisor.before_dispatch", "sink.after_commit", "worker.before_final",
                    "sink.before_final_ack")
# After a worker's death the retry is authorized once more than the calls were.
AFTER_WORKER = ("supervisor.before_authorize", "sink.after_authorize",
                "supervisor.before_dispatch")
# (check, act): a decision made, and the step that acts on it.
CHECK_ACT = (("supervisor.before_authorize", "sink.after_authorize"),
             ("sink.after_authorize", "supervisor.before_dispatch"),
             ("supervisor.before_dispatch", "sink.after_commit"),
             ("sink.after_commit", "worker.before_final"),
             ("worker.before_final", "sink.before_final_ack"),
             ("supervisor.before_rebind", "sink.after_rebind"),
             ("sink.after_rebind", "worker.after_rebind"))
# Points a single fault may arm: those the call mix passes without another fault
# (the cluster's only with --cluster).
SINGLES = tuple(p for p in failpoints.POINTS
                if p not in AFTER_SINK and p not in failpoints.CLUSTER_POINTS)
CLUSTER_SINGLES = SINGLES + failpoints.CLUSTER_POINTS
# P1 of a pair: steps passed while calls stream, so that a recovery follows.
PAIR_FIRST = ("supervisor.after_journal_commit", "supervisor.before_authorize",
              "supervisor.before_dispatch", "supervisor.after_fence", "sink.after_commit",
              "sink.before_final_ack", "worker.before_final", "sink.after_done_sent")
CALLS = 6  # the mix below: each call is authorized once when no fault intervenes


# ---- schedules -----------------------------------------------------------------------

@dataclass(frozen=True)
class Fault:
    point: str
    action: str  # crash | pause(Nms)
    nth: int = 1
    stage: int = 0  # 0: the daemon's start; 1: its restart after a supervisor crash

    def spec(self) -> str:
        return f"{self.point}={self.action}" + (f"@{self.nth}" if self.nth != 1 else "")


@dataclass(frozen=True)
class Schedule:
    index: int
    cls: str
    faults: tuple[Fault, ...]
    calls: tuple[Plan, ...]
    kill_sink_at: float | None = None  # seconds after the calls start
    cluster: bool = False  # the daemon is a host of a cluster (--cluster)

    def stages(self) -> list[str]:
        last = max((f.stage for f in self.faults), default=0)
        return [";".join(f.spec() for f in self.faults if f.stage == s) for s in range(last + 1)]

    def reproduce(self) -> str:
        stages = self.stages()
        text = f"STREAMFENCE_FAILPOINTS='{stages[0]}'"
        if len(stages) > 1:
            text += f", then, after the daemon's restart, '{stages[1]}'"
        if self.kill_sink_at is not None:
            text = f"{SINK_KILL} {self.kill_sink_at:.1f} s into the run; " + text
        return text + (" (a cluster host)" if self.cluster else "")

    def free(self) -> bool:
        """Every fault costs no provider request by design (the docstring's table)."""
        return all(f.action.startswith("pause") or f.point.split(".")[0] in ("sink", "gateway")
                   for f in self.faults)


def _pause(rng: random.Random) -> str:
    return f"pause({rng.randrange(200, 1500, 50)}ms)"


def _nth(rng: random.Random, point: str) -> int:
    if point == "sink.after_commit":
        return rng.randint(2, 25)  # a group commit: many per sink while the calls stream
    if point.startswith(("worker.", "gateway.")) or point in AFTER_SINK:
        return 1  # one pass per process (an attempt, a resumed stream)
    if point == "supervisor.after_fence":
        return 1  # the mix's one cancel fences once
    return rng.randint(1, 3)


def _first(rng: random.Random) -> tuple[Fault | None, float | None]:
    """P1 of a pair: a crash at a point (or an outside SIGKILL of the sink)."""
    if rng.random() < 0.25:
        return None, round(rng.uniform(0.5, 1.5), 1)
    point = rng.choice(PAIR_FIRST)
    return Fault(point, "crash", _nth(rng, point)), None


def _second(rng: random.Random, first: Fault | None, action: str) -> Fault:
    """P2: a step the recovery from `first` passes, never `first`'s own point
    (a point fires once per run: failpoints._first_firing)."""
    process = first.point.split(".")[0] if first else "sink"

    def choose(points: tuple[str, ...]) -> str:
        return rng.choice([p for p in points if first is None or p != first.point])
    if process == "sink":
        return Fault(choose(AFTER_SINK), action)
    if process == "supervisor":
        return Fault(choose(AFTER_SUPERVISOR), action, stage=1)
    return Fault(choose(AFTER_WORKER), action, CALLS + 1)


def _faults(rng: random.Random, cls: str, cluster: bool
            ) -> tuple[tuple[Fault, ...], float | None]:
    if cls in ("crash", "pause"):
        point = rng.choice(CLUSTER_SINGLES if cluster else SINGLES)
        return (Fault(point, "crash" if cls == "crash" else _pause(rng), _nth(rng, point)),), None
    if cls == "pause+crash":
        check, act = rng.choice(CHECK_ACT)
        pair = (Fault(check, _pause(rng)), Fault(act, "crash"))
        if check in AFTER_SINK:  # the rebind happens only after a sink's death
            return pair, round(rng.uniform(0.5, 1.5), 1)
        return pair, None
    first, kill_at = _first(rng)
    second = _second(rng, first, "crash" if cls == "crash+crash" else _pause(rng))
    return (*([first] if first else []), second), kill_at


def _calls(rng: random.Random) -> tuple[Plan, ...]:
    def wire() -> str:
        return rng.choice(WIRES)

    def policy() -> str:
        return rng.choice(("continue", "restart"))

    def chunks() -> int:
        return rng.randint(20, 40)

    http_wires = ("openai", "anthropic")  # the gateway's two endpoints
    return (Plan("c1", "zmq", wire(), policy(), chunks()),
            Plan("c2", "zmq", wire(), policy(), chunks()),
            Plan("c3", "zmq-resume", wire(), policy(), chunks(), rng.randint(0, 3)),
            Plan("c4", "zmq-cancel", wire(), policy(), 100),
            Plan("c5", "http", rng.choice(http_wires), "continue", chunks()),
            Plan("c6", "http-resume", rng.choice(http_wires), "continue", chunks(),
                 rng.randint(1, 3)))


def generate(seed: int, count: int, only: str | None, cluster: bool = False
             ) -> list[Schedule]:
    classes = [only] if only else list(CLASSES)
    out = []
    for i in range(count):
        rng = random.Random(seed * 1_000_003 + i)
        cls = classes[i % len(classes)]
        faults, kill_at = _faults(rng, cls, cluster)
        out.append(Schedule(i, cls, faults, _calls(rng), kill_at, cluster))
    return out


MAX_RESTARTS = 4  # starts after the first, per schedule


# ---- one run: a daemon (restarted after a supervisor's crash), the calls --------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Run:
    schedule: Schedule
    emulator: EmulatorProcess
    tmp: Path
    port: int = field(default_factory=_free_port)
    daemon: DaemonProcess | None = None
    stage: int = 0
    restarts: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    start_error: str = ""
    nats_urls: list[str] | None = None  # --cluster: the schedule's own NATS cluster

    @property
    def fp_dir(self) -> Path:
        return self.tmp / "failpoints"

    def current(self) -> DaemonProcess:
        assert self.daemon is not None
        return self.daemon

    def start(self) -> None:
        stages = self.schedule.stages()
        spec = stages[min(self.stage, len(stages) - 1)]
        providers = {w: dict(emulator_profile(w, self.emulator.base_url),
                             stale_timeout_s=STALE_S, max_attempts=4) for w in WIRES}
        tables: dict[str, dict[str, Any]] = {"http": {"listen": f"127.0.0.1:{self.port}"}}
        if self.nats_urls is not None:  # a lease well above the pauses: one host only
            tables["cluster"] = {"urls": self.nats_urls, "host": "host-a", "replicas": 3,
                                 "lease_s": 5.0}
        daemon = DaemonProcess(
            self.tmp / "state", providers, log_json=False,
            daemon={"workers_spare": 3, "workers_max": 12, "log_level": "INFO"},
            env={failpoints.ENV: spec, failpoints.DIR_ENV: str(self.fp_dir)},
            tables=tables)
        daemon.log_path = self.tmp / "daemon.log"
        self.daemon = daemon
        daemon.start(ready_timeout=40.0)

    def watch(self) -> None:
        """Restart the daemon when its supervisor dies (a supervisor crash point)."""
        while not self.stop.wait(0.05):
            proc = self.current().proc
            if proc is None or proc.poll() is None:
                continue
            self.current().cleanup()
            self.stage += 1
            self.restarts += 1
            try:
                self.start()
            except DaemonExited as exc:
                # A planned crash in the start itself (the restart's recovery
                # passes P2): start again, as systemd would; a fired point
                # does not fire twice. Bounded: a daemon that never starts
                # is the verdict's.
                if self.restarts < MAX_RESTARTS:
                    continue
                self.start_error = f"{type(exc).__name__}: {str(exc)[:300]}"
                return
            except Exception as exc:  # the verdict says it; the calls end lost
                self.start_error = f"{type(exc).__name__}: {str(exc)[:300]}"
                return

    def kill_sink(self, at: float) -> None:
        if self.stop.wait(at):
            return
        try:
            with self.current().client(timeout_s=3.0) as client:
                pid = client.status()["processes"]["sink"]
            os.kill(pid, signal.SIGKILL)
            (self.fp_dir / "killed.sink").touch()
        except (TimeoutError, ClientError, ProcessLookupError, TypeError):
            pass


# ---- the judge --------------------------------------------------------------------------

@dataclass
class Outcome:
    schedule: Schedule
    violations: list[str]
    fired: list[str]  # the planned faults that fired, in the order they fired
    in_order: bool  # every planned fault fired, P1 before P2
    seconds: float
    hits: Counter[str]
    statuses: Counter[str]
    stalls: list[str] = field(default_factory=list)  # subscribers that waited > STALL_S


def _fired(run: Run) -> list[str]:
    names = [(p.stat().st_mtime, p.name.removeprefix("fired.").removeprefix("killed."))
             for p in run.fp_dir.glob("*.*") if p.name.startswith(("fired.", "killed."))]
    return [name for _, name in sorted(names)]


def judge_run(run: Run, followed: list[Followed], emu: EmulatorClient, started: float
              ) -> Outcome:
    s = run.schedule
    deadline = time.monotonic() + 5.0  # a killed stream's connection closes within this
    logs: dict[str, list[dict[str, Any]]] = {}
    while True:
        logs = {f.key: emu.log(f.key) for f in followed}
        if all(r.get("ended") is not None for rs in logs.values() for r in rs) or \
                time.monotonic() > deadline:
            break
        time.sleep(0.1)
    violations = [f"{f.plan.name} {f.plan.show()}: {label}"
                  for f in followed for label in judge_call(f, logs[f.key], s.free())]
    if run.start_error:
        violations.append(f"the daemon did not start again: {run.start_error}")
    run.current().cleanup()
    violations += [f"survivor: {p}" for p in run.current().survivors]
    fired = _fired(run)
    planned = (["sink"] if s.kill_sink_at is not None else []) + [f.point for f in s.faults]
    in_order = [name for name in fired if name in planned] == planned
    statuses = Counter(str((f.record.done or {}).get("status", "lost")) for f in followed)
    stalls = [f"{f.plan.name} {f.silence:.1f} s" for f in followed if f.silence > STALL_S]
    if s.free():  # a fault that costs nothing by design must not stop a stream either
        violations += [f"{f.plan.name} {f.plan.show()}: stalled ({f.silence:.1f} s without "
                       f"an event)" for f in followed if f.silence > STALL_S]
    return Outcome(s, violations, fired, in_order, time.monotonic() - started,
                   Counter(failpoints.hits(str(run.fp_dir))), statuses, stalls)


def run_schedule(s: Schedule, emulator: EmulatorProcess, emu: EmulatorClient) -> Outcome:
    with tempfile.TemporaryDirectory(prefix="streamfence-sched-") as tmp, \
            contextlib.ExitStack() as stack:
        urls = stack.enter_context(nats_cluster(Path(tmp) / "nats")).urls if s.cluster else None
        run = Run(s, emulator, Path(tmp), nats_urls=urls)
        run.fp_dir.mkdir()
        tag = f"s{s.index}-{random.SystemRandom().randrange(1 << 24):x}"
        followed = [Followed(p, f"{tag}-{p.name}", CallRecord("", f"{tag}-{p.name}"))
                    for p in s.calls]
        for f in followed:
            emu.script(f.key, [{"fault": "ok", "chunks": f.plan.chunks,
                                "chunk_delay_s": 0.05}] * 4)
        started = time.monotonic()
        try:
            run.start()
        except Exception as exc:
            run.current().cleanup()
            return Outcome(s, [f"the daemon did not start: {str(exc)[:300]}"], [], False,
                           time.monotonic() - started, Counter(), Counter())
        helpers = [threading.Thread(target=run.watch, daemon=True)]
        if s.kill_sink_at is not None:
            helpers.append(threading.Thread(target=run.kill_sink, args=(s.kill_sink_at,),
                                            daemon=True))
        deadline = time.monotonic() + CALL_DEADLINE_S
        calls = [threading.Thread(target=follow_http if f.plan.kind.startswith("http")
                                  else follow_zmq, args=(run, f, deadline), daemon=True)
                 for f in followed]
        for t in helpers + calls:
            t.start()
        for t in calls:
            t.join(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
        for f in followed:
            if f.plan.kind.startswith("http"):
                transcript(run, f, deadline)
        run.stop.set()
        for t in helpers:
            t.join(timeout=60.0)
        outcome = judge_run(run, followed, emu, started)
        if outcome.violations:
            tail = run.tmp.joinpath("daemon.log").read_text(errors="replace").splitlines()
            print("    daemon log tail:\n      " + "\n      ".join(tail[-12:]))
        return outcome


# ---- the report -------------------------------------------------------------------------

def _line(o: Outcome) -> str:
    state = "ok" if not o.violations else f"{len(o.violations)} VIOLATION(S)"
    fired = ",".join(o.fired) or "nothing"
    return (f"[{o.schedule.index:>3}] {o.schedule.cls:<11} {o.schedule.reproduce()}\n"
            f"      fired: {fired} ({'as planned' if o.in_order else 'NOT as planned'}); "
            f"calls: {dict(o.statuses)}; {state}; {o.seconds:.1f} s"
            + (f"\n      STALLED (a subscriber waited): {', '.join(o.stalls)}" if o.stalls else ""))


def report(outcomes: list[Outcome], seed: int) -> bool:
    print("\nclass        schedules  as planned  free  stalled  violations")
    for cls in CLASSES:
        mine = [o for o in outcomes if o.schedule.cls == cls]
        if mine:
            print(f"{cls:<12} {len(mine):>9}  {sum(o.in_order for o in mine):>10}  "
                  f"{sum(o.schedule.free() for o in mine):>4}  "
                  f"{sum(bool(o.stalls) for o in mine):>7}  "
                  f"{sum(bool(o.violations) for o in mine):>10}")
    hits: Counter[str] = sum((o.hits for o in outcomes), Counter())
    print(f"faults fired as planned: {sum(o.in_order for o in outcomes)}/{len(outcomes)}")
    print(f"points passed (armed): {dict(sorted(hits.items()))}")
    failing = [o for o in outcomes if o.violations]
    for o in failing:
        print(f"\nFAILING schedule {o.schedule.index} ({o.schedule.cls}, seed {seed}):")
        print(f"  {o.schedule.reproduce()}")
        print("  calls: " + "; ".join(f"{p.name} {p.show()}" for p in o.schedule.calls))
        for v in o.violations:
            print(f"  - {v}")
    print(f"\nseed: {seed}  schedules: {len(outcomes)}  violations: "
          f"{sum(len(o.violations) for o in outcomes)}  verdict: "
          f"{'PASS' if not failing else 'FAIL'}")
    return not failing


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedules", type=int, default=20)
    p.add_argument("--seed", type=int, default=None, help="random seed (printed)")
    p.add_argument("--only", choices=(*CLASSES, host_pause.CLASS),
                   help="schedules of this class only")
    p.add_argument("--index", type=int, action="append",
                   help="run schedule K of the seed's list only (repeatable)")
    p.add_argument("--list", action="store_true", help="print the schedules, run nothing")
    p.add_argument("--cluster", action="store_true",
                   help="each daemon a host of a cluster (a NATS cluster per schedule)")
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    print(f"seed: {seed}  (rerun with --seed {seed})", flush=True)
    if args.only == host_pause.CLASS:
        return host_pause.explore(seed, args.schedules, args.index, args.list)
    count = max(args.schedules, max(args.index or [0]) + 1)
    schedules = [s for s in generate(seed, count, args.only, args.cluster)
                 if args.index is None or s.index in args.index]
    if args.list:
        for s in schedules:
            print(f"[{s.index:>3}] {s.cls:<11} {s.reproduce()}\n      calls: "
                  + "; ".join(f"{c.name} {c.show()}" for c in s.calls))
        return 0
    outcomes = []
    with EmulatorProcess() as emulator:
        emu = emulator.client()
        for s in schedules:
            outcome = run_schedule(s, emulator, emu)
            outcomes.append(outcome)
            print(_line(outcome), flush=True)
            for v in outcome.violations:
                print(f"      - {v}", flush=True)
    return 0 if report(outcomes, seed) else 1


if __name__ == "__main__":
    sys.exit(main())
