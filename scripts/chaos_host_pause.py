"""The explorer's `host-pause` class (issue 30): a whole host standing
still, past its lease, in one of the cluster's check-then-act windows.

    python -m scripts.chaos_schedules --only host-pause [--schedules 12] [--seed S]
                                      [--index K] [--list]

Each schedule starts a real 3-node NATS cluster and two hosts on it (two
daemons, host-a and host-b, lease LEASE_S), submits CALLS calls to host-a,
and arms one of the ledger's points (docs/ARCHITECTURE.md §7) with a pause
longer than the lease in one host:

    side   the host that stands still
    owner  host-a, at its own take (`cluster.before_take`: an attempt's owner
           entry read, its compare-and-set not yet sent) or epoch open
           (`cluster.before_epoch_append`: the log's last record judged, the
           conditional append not yet sent) of one of its calls: host-b finds
           its lease lost and takes its calls over meanwhile
    taker  host-b, at the take or the epoch open of its own takeover, after
           host-a lost its lease (`kill`: kill -9 of its tree, started again
           once host-b stands still; `freeze`: SIGSTOP of its tree for 2.5
           leases): host-a, back, may take the calls from it meanwhile

A point's pause stands only the ledger's thread still, in whichever process
passes it (the supervisor or the sink); to stand the whole host still
there, this script stops every process of the host (SIGSTOP) as soon as the
point fires (its marker in the host's STREAMFENCE_FAILPOINTS_DIR) and wakes
them (SIGCONT) when the pause is over.

The judge, per call, never from the hosts' counters: its log on JetStream
(void records skipped) holds one answer, to a done (else `lost`), not
duplicated, interleaved or superseded (streamfence.devtools.verdict); the
log's epoch records never go down (`epoch_below`: what issue 30's
check-then-act let through); each host's subscriber, from seq 0, gets
exactly the log's events; at most 1 + the changes of host provider
requests (a takeover may run a call again), counted along the log's epoch
records, and one more where the log starts above epoch 1 (a first attempt
makes its request while its epoch's open is in flight, sink/replica.py: a
host that stands still before that append never gets it into the log, yet
its request was made), one more where host-a was killed (its recovery runs
its calls again), else `extra_request`; every provider request closed (`open_request`); no
process outlives its host (`survivor`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import shutil
import signal
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scripts.chaos_common import process_tree, signal_all, unpack_events
from streamfence.cluster.ledger import Ledger
from streamfence.cluster.records import EPOCH, EVENTS, Record, valid
from streamfence.cluster.settings import ClusterSettings
from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess
from streamfence.devtools.launcher import DaemonProcess
from streamfence.devtools.nats_cluster import NatsCluster
from streamfence.devtools.verdict import BAD, CallRecord, judge
from streamfence.protocol import failpoints
from streamfence.protocol.client import ClientError

CLASS = "host-pause"
HOSTS = ("host-a", "host-b")
LEASE_S = 2.0
CALLS = 4  # submitted to host-a
SUBMIT_GAP_S = 0.5
CHUNK_S = 0.05
DEADLINE_S = 90.0  # every call's done in its log, from the calls' submit
FIRED_WITHIN_S = 30.0  # the armed point fires this soon after the submit, or never
# The kinds, in turn: every len(KINDS) schedules cover each once.
KINDS: tuple[tuple[str, str, str | None], ...] = (
    *(("owner", p, None) for p in failpoints.CLUSTER_POINTS),
    *(("taker", p, loss) for p in failpoints.CLUSTER_POINTS for loss in ("kill", "freeze")))


@dataclass(frozen=True)
class HostPause:
    index: int
    side: str  # owner | taker
    point: str
    nth: int
    pause_ms: int
    loss: str | None  # taker: how host-a loses its lease first (kill | freeze)
    loss_at: float  # ... this many seconds after the calls' submit
    chunks: tuple[int, ...]  # each call's, CHUNK_S apart
    cls: str = CLASS

    @property
    def paused(self) -> str:
        return HOSTS[0] if self.side == "owner" else HOSTS[1]

    def specs(self) -> dict[str, str]:
        spec = f"{self.point}=pause({self.pause_ms}ms)" + (f"@{self.nth}" if self.nth > 1 else "")
        return {host: spec if host == self.paused else "" for host in HOSTS}

    def reproduce(self) -> str:
        text = "; ".join(f"{host}: STREAMFENCE_FAILPOINTS='{spec}'"
                         for host, spec in self.specs().items())
        text += f" ({self.paused} stands still from the point)"
        if self.loss == "kill":
            text = (f"kill -9 of host-a {self.loss_at:.1f} s into the run, started again once "
                    f"host-b stands still; " + text)
        elif self.loss == "freeze":
            text = f"SIGSTOP of host-a {self.loss_at:.1f} s into the run for 2.5 leases; " + text
        return text

    def show_calls(self) -> str:
        return f"{CALLS} calls to host-a, {', '.join(map(str, self.chunks))} chunks"


def generate(seed: int, count: int) -> list[HostPause]:
    out = []
    for i in range(count):
        rng = random.Random(seed * 1_000_003 + i)
        side, point, loss = KINDS[i % len(KINDS)]
        # owner: one of the first calls' attempts; taker: one of its first takeovers
        nth = rng.randint(1, 3) if side == "owner" else rng.randint(1, 2)
        pause_ms = rng.randrange(int(LEASE_S * 2000), int(LEASE_S * 4000), 250)
        chunks = tuple(rng.randint(100, 160) for _ in range(CALLS))  # 5-8 s each
        out.append(HostPause(i, side, point, nth, pause_ms, loss,
                             round(rng.uniform(1.0, 2.0), 1), chunks))
    return out


# ---- one run --------------------------------------------------------------------------

@dataclass
class Run:
    schedule: HostPause
    tmp: Path
    nats: NatsCluster
    emulator: EmulatorProcess
    hosts: dict[str, DaemonProcess] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)
    notes: list[str] = field(default_factory=list)  # what happened, when
    started: float = field(default_factory=time.monotonic)
    stood_still: threading.Event = field(default_factory=threading.Event)
    errors: list[str] = field(default_factory=list)

    def note(self, what: str) -> None:
        self.notes.append(f"{time.monotonic() - self.started:5.1f} s {what}")

    def fp_dir(self, host: str) -> Path:
        return self.tmp / f"failpoints-{host}"

    def start_hosts(self) -> None:
        for host, spec in self.schedule.specs().items():
            self.fp_dir(host).mkdir(exist_ok=True)
            self.hosts[host] = DaemonProcess(
                self.tmp / host, {"emu": {"kind": "openai",
                                          "base_url": self.emulator.openai_base_url,
                                          "stale_timeout_s": 60.0, "max_attempts": 6}},
                daemon={"workers_spare": 4, "workers_max": 16, "log_level": "INFO"},
                env={failpoints.ENV: spec, failpoints.DIR_ENV: str(self.fp_dir(host))},
                tables={"cluster": {"urls": self.nats.urls, "host": host, "replicas": 3,
                                    "lease_s": LEASE_S}}, log_json=True).start(120.0)

    def stand_still(self) -> None:
        """When the armed point fires, stop the host's whole tree until its pause is over."""
        s = self.schedule
        marker = self.fp_dir(s.paused) / f"fired.{s.point}"
        given_up = time.monotonic() + FIRED_WITHIN_S
        while not marker.exists():
            if self.stop.wait(0.01) or time.monotonic() > given_up:
                return  # never fired: not as planned (the report says so)
        pids = process_tree(self.hosts[s.paused])
        signal_all(pids, signal.SIGSTOP)
        self.note(f"{s.paused} fired {s.point}: stands still")
        self.stood_still.set()
        self.stop.wait(max(0.0, marker.stat().st_mtime + s.pause_ms / 1000 - time.time()))
        signal_all(pids, signal.SIGCONT)
        self.note(f"{s.paused} goes on")

    def lose_lease(self) -> None:
        """host-a loses its lease (the taker side): killed, or frozen."""
        s = self.schedule
        if self.stop.wait(s.loss_at):
            return
        host = self.hosts[HOSTS[0]]
        pids = process_tree(host)
        if s.loss == "freeze":
            signal_all(pids, signal.SIGSTOP)
            self.note("host-a frozen")
            self.stop.wait(2.5 * LEASE_S)
            signal_all(pids, signal.SIGCONT)
            self.note("host-a woken")
            return
        signal_all(pids, signal.SIGKILL)
        self.note("host-a killed")
        with contextlib.suppress(Exception):
            host.proc.wait(timeout=10)  # type: ignore[union-attr]
        # Started again while host-b stands still (or after 4 leases if it never does).
        self.stood_still.wait(4 * LEASE_S)
        if self.stop.is_set():
            return
        try:
            host.start(120.0)
            self.note("host-a started again")
        except Exception as exc:  # the verdict says it
            self.errors.append(f"host-a did not start again: {type(exc).__name__}: "
                               f"{str(exc)[:300]}")


def _submit(run: Run, record: CallRecord, i: int, deadline: float) -> None:
    """Submit to host-a, SUBMIT_GAP_S after the call before (so that the first
    ones stream when a later one's take stands host-a still), with an
    idempotency key until answered (a host that stands still answers late;
    the key makes the retry the same call)."""
    if run.stop.wait(i * SUBMIT_GAP_S):
        return
    while not record.call_id and time.monotonic() < deadline:
        try:
            with run.hosts[HOSTS[0]].client(timeout_s=20.0) as client:
                record.call_id = client.submit(
                    "emu", {"model": f"gpt-emu#{record.key}",
                            "messages": [{"role": "user", "content": f"host pause call {i}"}]},
                    subscribe=False, idempotency_key=record.key)
        except (TimeoutError, ClientError, OSError) as exc:
            record.errors.append(f"{type(exc).__name__}: {exc}"[:300])
            time.sleep(0.3)


def _events(records: list[Record]) -> list[dict[str, Any]]:
    """The public events of a log's valid EVENTS records, in order."""
    out: list[dict[str, Any]] = []
    for rec in valid(records):
        if rec.kind == EVENTS:
            for *_, body in rec.body:
                out.extend(unpack_events(body))
    return out


async def _logs(nats: NatsCluster, call_ids: list[str], deadline: float,
                ) -> dict[str, list[Record]]:
    """Each call's whole log, once its valid events hold a done (or at the deadline)."""
    ledger = await Ledger.connect(ClusterSettings(tuple(nats.urls), "chaos-reader"))
    logs: dict[str, list[Record]] = {}
    try:
        pending = list(call_ids)
        while True:
            for call_id in list(pending):
                with contextlib.suppress(Exception):
                    logs[call_id] = await ledger.read(call_id)
                    if any(e.get("op") == "done" for e in _events(logs[call_id])):
                        pending.remove(call_id)
            if not pending or time.monotonic() > deadline:
                return logs
            await asyncio.sleep(0.5)
    finally:
        await ledger.close()


def _epochs(log: list[Record]) -> str:
    """The log's epoch records, as a2>b3 (host-a's epoch 2, then host-b's 3)."""
    return ">".join(f"{r.host[-1]}{r.epoch}" for r in log if r.kind == EPOCH) or "none"


def _view(host: DaemonProcess, call_id: str) -> list[dict[str, Any]] | str:
    """What a subscriber of `host` gets of the call from seq 0 to its done."""
    try:
        with host.client(timeout_s=10.0) as client:
            client.subscribe(call_id, from_seq=0)
            return list(client.events(call_id, timeout_s=20.0))
    except (TimeoutError, ClientError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"[:200]


class _NotRun(Exception):
    """The schedule could not run (its violations say why)."""


@dataclass
class Outcome:
    schedule: HostPause
    violations: list[str]
    in_order: bool  # the armed point fired
    seconds: float
    statuses: Counter[str]
    requests: int
    notes: list[str]


def _judge_call(emu: EmulatorClient, record: CallRecord, log: list[Record],
                views: dict[tuple[str, str], list[dict[str, Any]] | str],
                restarts: int) -> list[str]:
    """The call's violations; `restarts`: of host-a (its recovery runs its calls again)."""
    name = f"{record.key} ({record.call_id or 'never accepted'})"
    if not record.call_id:
        return [f"{name}: lost (never accepted: {record.errors[-1:]})"]
    record.events = _events(log)
    sent = emu.log(record.key)
    labels = [label for label in judge(record, sent) if label in BAD]
    epochs = [r for r in log if r.kind == EPOCH]
    if any(b.epoch < a.epoch for a, b in itertools.pairwise(epochs)):
        labels.append("epoch_below " + str([(r.epoch, r.host) for r in epochs]))
    moves = sum(a.host != b.host for a, b in itertools.pairwise(epochs))
    if epochs and epochs[0].epoch > 1:
        # Epoch 1's open never stored: its attempt's request went with the open in
        # flight, and its host was another (a host's opens of a call go in order).
        moves += 1
    if len(sent) > 1 + moves + restarts:
        labels.append(f"extra_request ({len(sent)} requests, {moves} change(s) of host, "
                      f"{restarts} restart(s) of its host)")
    if any(r.get("ended") is None for r in sent):
        labels.append("open_request")
    for host in HOSTS:
        seen = views[host, record.call_id]
        if seen != record.events:
            if isinstance(seen, str):
                shown = seen
            else:
                at = next((i for i, (a, b) in enumerate(zip(seen, record.events, strict=False))
                           if a != b), min(len(seen), len(record.events)))
                shown = f"{len(seen)} events, differing from the log's at event {at + 1}"
            labels.append(f"{host}'s subscriber got {shown}; the log holds "
                          f"{len(record.events)}")
    return [f"{name}: {label}" for label in labels]


def run_schedule(s: HostPause, emulator: EmulatorProcess, emu: EmulatorClient) -> Outcome:
    with tempfile.TemporaryDirectory(prefix="streamfence-hostpause-") as tmp:
        nats = NatsCluster(Path(tmp) / "nats").start()
        run = Run(s, Path(tmp), nats, emulator)
        records = [CallRecord("", f"hp{s.index}-{random.SystemRandom().randrange(1 << 24):x}-{i}")
                   for i in range(CALLS)]
        violations: list[str] = []
        try:
            try:
                run.start_hosts()
            except Exception as exc:  # a host that cannot start fails the schedule
                violations.append(f"the hosts did not start: {type(exc).__name__}: "
                                  f"{str(exc)[-600:]}")
                raise _NotRun from None
            for r, chunks in zip(records, s.chunks, strict=True):
                emu.script(r.key, [{"fault": "ok", "chunks": chunks,
                                    "chunk_delay_s": CHUNK_S}] * 4)
            run.started = time.monotonic()
            deadline = run.started + DEADLINE_S
            helpers = [threading.Thread(target=run.stand_still, daemon=True)]
            if s.side == "taker":
                helpers.append(threading.Thread(target=run.lose_lease, daemon=True))
            submits = [threading.Thread(target=_submit, args=(run, r, i, deadline), daemon=True)
                       for i, r in enumerate(records)]
            for t in helpers + submits:
                t.start()
            for t in submits + helpers:  # the host that stood still has gone on
                t.join(timeout=max(0.0, deadline - time.monotonic()))
            call_ids = [r.call_id for r in records if r.call_id]
            asyncio.run(_logs(nats, call_ids, deadline))
            wait_ended = time.monotonic() + 10.0  # a killed worker's request closes by then
            while time.monotonic() < wait_ended and any(
                    x["ended"] is None for r in records for x in emu.log(r.key)):
                time.sleep(0.2)
            views = {(host, r.call_id): _view(proc, r.call_id)
                     for host, proc in run.hosts.items() for r in records if r.call_id}
            logs = asyncio.run(_logs(nats, call_ids, deadline))  # after all that: final
            violations += run.errors
            for r in records:
                violations += _judge_call(emu, r, logs.get(r.call_id, []), views,
                                          int(s.loss == "kill"))
            run.note("epochs: " + ", ".join(_epochs(logs.get(r.call_id, [])) for r in records))
        except _NotRun:
            pass
        finally:
            run.stop.set()
            for proc in run.hosts.values():
                signal_all(process_tree(proc), signal.SIGCONT)
                proc.cleanup()
            nats.stop()
        violations += [f"survivor of {h}: {p}" for h, proc in run.hosts.items()
                       for p in proc.survivors]
        statuses = Counter(str((r.done or {}).get("status", "lost")) for r in records)
        fired = (run.fp_dir(s.paused) / f"fired.{s.point}").exists()
        if violations:
            kept = Path(tempfile.mkdtemp(prefix="streamfence-hostpause-logs-"))
            for host, proc in run.hosts.items():
                with contextlib.suppress(OSError):
                    shutil.copy(proc.log_path, kept / f"{host}.log")
                warnings = [f"{x.get('levelname', x.get('level'))} {x.get('message')}"[:200]
                            for x in proc.log_records()
                            if str(x.get("level", x.get("levelname", ""))) in
                            ("WARNING", "ERROR", "CRITICAL")]
                print(f"    {host}'s last warnings:\n      " + "\n      ".join(warnings[-10:]))
            print(f"    the hosts' logs: {kept}")
        return Outcome(s, violations, fired, time.monotonic() - run.started, statuses,
                       sum(len(emu.log(r.key)) for r in records), run.notes)


# ---- the class's report ---------------------------------------------------------------

def _line(o: Outcome) -> str:
    s = o.schedule
    state = "ok" if not o.violations else f"{len(o.violations)} VIOLATION(S)"
    return (f"[{s.index:>3}] {CLASS} {s.side:<5} {s.reproduce()}\n"
            f"      fired: {'as planned' if o.in_order else 'NOT as planned'}; "
            f"calls: {dict(o.statuses)}; provider requests: {o.requests}; {state}; "
            f"{o.seconds:.1f} s\n      " + "; ".join(o.notes))


def explore(seed: int, count: int, indexes: list[int] | None, listing: bool) -> int:
    schedules = [s for s in generate(seed, max(count, max(indexes or [0]) + 1))
                 if indexes is None or s.index in indexes]
    if listing:
        for s in schedules:
            print(f"[{s.index:>3}] {CLASS} {s.side:<5} {s.reproduce()}\n      calls: "
                  + s.show_calls())
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
    print("\nclass       side   point                          schedules  as planned  "
          "violations")
    for side, point in dict.fromkeys((k[0], k[1]) for k in KINDS):
        mine = [o for o in outcomes if (o.schedule.side, o.schedule.point) == (side, point)]
        if mine:
            print(f"{CLASS:<11} {side:<6} {point:<30} {len(mine):>9}  "
                  f"{sum(o.in_order for o in mine):>10}  "
                  f"{sum(bool(o.violations) for o in mine):>10}")
    failing = [o for o in outcomes if o.violations]
    for o in failing:
        print(f"\nFAILING schedule {o.schedule.index} ({CLASS}, seed {seed}; rerun: "
              f"--only {CLASS} --seed {seed} --index {o.schedule.index}):")
        print(f"  {o.schedule.reproduce()}")
        print(f"  calls: {o.schedule.show_calls()}")
        for v in o.violations:
            print(f"  - {v}")
    print(f"\nseed: {seed}  schedules: {len(outcomes)}  violations: "
          f"{sum(len(o.violations) for o in outcomes)}  verdict: "
          f"{'PASS' if not failing else 'FAIL'}")
    return 1 if failing else 0
