"""Chaos for cluster mode (issue 16; docs/ARCHITECTURE.md §4.17): three
streamfence hosts on one 3-node NATS JetStream cluster, on this machine
(separate state dirs and endpoints), under a load of calls submitted to the
hosts in turn, while one fault at a time hits them (random, seeded):

- `kill`:   kill -9 of a whole host (its process tree) mid-stream; restarted
            on its state dir after two leases;
- `freeze`: SIGSTOP of a host's tree for 2.5 leases, then SIGCONT: a zombie
            host, whose calls the others took meanwhile; its late appends
            must be refused by the engine and counted, and its provider
            connections closed once it notices;
- `nats`:   kill -9 of one NATS node (the quorum carries on), restarted 3 s
            later on its store.

The verdict is computed from the calls' logs on JetStream (what any host
serves of a call: its events, void records skipped), from what a
subscriber reads of a sample of them from a host chosen at random (equal to
the log), and from the emulator's own record of what it sent (streamfence.devtools.verdict), never
from the hosts' counters: 0 lost, 0 interleaved, 0 duplicated, 0
superseded among the accepted calls. A submit the client saw no answer to
(its host was killed or frozen) promised nothing; it is counted apart.
Loopback only; every loop is bounded.

    python -m scripts.chaos_cluster --seed 2026 --duration 60
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from scripts.chaos_common import parser, process_tree, seeded, signal_all, unpack_events
from streamfence.cluster.ledger import Ledger
from streamfence.cluster.records import EVENTS, valid
from streamfence.cluster.settings import ClusterSettings
from streamfence.devtools.emulator.control import EmulatorProcess
from streamfence.devtools.launcher import DaemonProcess
from streamfence.devtools.nats_cluster import NatsCluster
from streamfence.devtools.verdict import BAD, CallRecord, judge, tally, verdict_ok
from streamfence.protocol.client import ClientError

HOSTS = ("host-a", "host-b", "host-c")
FAULTS = ("freeze", "nats", "kill")  # each once first, in this order (a restart is slowest)


class Cluster:
    """The emulator, the NATS nodes, the hosts, and what was injected."""

    def __init__(self, root: Path, emulator: EmulatorProcess, nats: NatsCluster,
                 lease_s: float) -> None:
        self.nats = nats
        self.emu = emulator.client()
        self.hosts = {name: DaemonProcess(
            root / name, {"emu": {"kind": "openai", "base_url": emulator.openai_base_url,
                                  "stale_timeout_s": 5.0, "max_attempts": 6}},
            daemon={"workers_spare": 4, "workers_max": 32, "backoff_base_s": 0.05,
                    "backoff_max_s": 0.3, "log_level": "WARNING"},
            tables={"cluster": {"urls": nats.urls, "host": name, "replicas": 3,
                                "lease_s": lease_s}}, log_json=True) for name in HOSTS}
        self.down: set[str] = set()  # hosts killed or frozen now
        self.injected: dict[str, int] = {}
        self.refused = 0  # appends the engine refused, as the frozen hosts counted them
        self.lock = threading.Lock()
        self.started = time.monotonic()
        self.errors: list[str] = []  # faults that could not be carried out (a host did not restart)

    def count(self, what: str) -> None:
        self.injected[what] = self.injected.get(what, 0) + 1

    def note(self, what: str) -> None:
        print(f"  {time.monotonic() - self.started:6.1f} s  {what}", flush=True)

    def up(self) -> list[str]:
        with self.lock:
            return [h for h in HOSTS if h not in self.down]

    def fault(self, kind: str, rng: random.Random, lease_s: float, stop: threading.Event) -> None:
        if kind == "nats":
            node = rng.randrange(len(self.nats.nodes))
            self.nats.kill(node)
            self.count("NATS node kill -9 + restart")
            self.note(f"NATS node {node + 1} killed")
            stop.wait(3.0)
            self.nats.restart(node)
            self.note(f"NATS node {node + 1} restarted")
            return
        victims = self.up()
        if len(victims) < 2:
            return
        name = rng.choice(victims)
        host = self.hosts[name]
        with self.lock:
            self.down.add(name)
        pids = process_tree(host)
        if kind == "kill":
            signal_all(pids, signal.SIGKILL)
            self.count("host kill -9 (its process tree) + restart")
            self.note(f"{name} killed")
            stop.wait(2 * lease_s)
            with contextlib.suppress(Exception):
                host.proc.wait(timeout=10)  # type: ignore[union-attr]
            host.start(ready_timeout=120.0)
            self.note(f"{name} started again")
        else:
            signal_all(pids, signal.SIGSTOP)
            self.count("host SIGSTOP past its lease + SIGCONT (a zombie host)")
            self.note(f"{name} frozen")
            stop.wait(2.5 * lease_s)
            signal_all(pids, signal.SIGCONT)
            self.note(f"{name} woken")
            stop.wait(lease_s)  # it notices: its sink's next appends are refused
            with contextlib.suppress(Exception), host.client(timeout_s=5.0) as client:
                self.refused += int(client.status()["sink"].get("cluster_engine_refused", 0))
        with self.lock:
            self.down.discard(name)


def _submit(cluster: Cluster, record: CallRecord, request: dict[str, Any], i: int) -> None:
    """One submit, to the next host up; `record.call_id` set if it was accepted."""
    up = cluster.up()
    if not up:
        record.errors.append("no host up")
        return
    host = cluster.hosts[up[i % len(up)]]
    try:
        with host.client(timeout_s=5.0) as client:
            record.call_id = client.submit("emu", request, subscribe=False,
                                           session_id=f"chaos-{record.key}")
    except (TimeoutError, ClientError, OSError) as exc:
        record.errors.append(f"{type(exc).__name__}: {exc}"[:300])


async def _read_logs(nats: NatsCluster, records: list[CallRecord], deadline: float) -> None:
    """Each accepted call's events as its log holds them, once it holds a done."""
    ledger = await Ledger.connect(ClusterSettings(tuple(nats.urls), "chaos-reader"))
    try:
        pending = [r for r in records if r.call_id]
        while pending and time.monotonic() < deadline:
            for r in list(pending):
                with contextlib.suppress(Exception):
                    events = []
                    for rec in valid(await ledger.read(r.call_id)):
                        if rec.kind == EVENTS:
                            for *_, body in rec.body:
                                events.extend(unpack_events(body))
                    if any(e.get("op") == "done" for e in events):
                        r.events = events
                        pending.remove(r)
            if pending:
                await asyncio.sleep(0.5)
    finally:
        await ledger.close()


async def _explain(nats: NatsCluster, lost: list[CallRecord]) -> None:
    ledger = await Ledger.connect(ClusterSettings(tuple(nats.urls), "chaos-reader"))
    try:
        for r in lost:
            owner = await ledger.owner(r.call_id)
            log = [(x.kind, x.epoch, x.host, [row[:5] for row in x.body] if x.body else None)
                   for x in await ledger.read(r.call_id)]
            print(f"  {r.call_id}: owner {owner}, {len(log)} records (kind, epoch, host, rows "
                  f"(seq, last, attempt, op, n)):")
            for entry in log:
                print(f"      {entry}")
    finally:
        await ledger.close()


def main() -> int:
    p = parser(__doc__.split("\n")[0], calls=2000, duration=60.0)
    p.add_argument("--lease", type=float, default=2.0, help="[cluster] lease_s of every host")
    p.add_argument("--storm", type=float, default=8.0, help="seconds between two faults")
    p.add_argument("--sample", type=int, default=100,
                   help="calls read by a subscriber of a host at random for the verdict")
    args = p.parse_args()
    rng = seeded(args)
    with tempfile.TemporaryDirectory(prefix="streamfence-chaos-cluster-") as tmp, \
            EmulatorProcess() as emulator:
        nats = NatsCluster(Path(tmp) / "nats").start()
        cluster = Cluster(Path(tmp), emulator, nats, args.lease)
        stop = threading.Event()
        try:
            for host in cluster.hosts.values():
                host.start(ready_timeout=120.0)
            cluster.started = time.monotonic()
            cluster.note("hosts up; load and faults start")
            faults = threading.Thread(target=_faults, args=(cluster, rng, args, stop),
                                      daemon=True)
            faults.start()
            records = _load(cluster, rng, args)
            stop.set()
            faults.join(timeout=60.0)
            for name in HOSTS:  # a frozen host is woken before the verdict
                signal_all(process_tree(cluster.hosts[name]), signal.SIGCONT)
            asyncio.run(_read_logs(nats, records, time.monotonic() + 120.0))
            served = _subscribers_view(cluster, records, rng, args.sample)
            return _verdict(cluster, records, served)
        finally:
            stop.set()
            for host in cluster.hosts.values():
                signal_all(process_tree(host), signal.SIGCONT)
                host.cleanup()
            nats.stop()


def _faults(cluster: Cluster, rng: random.Random, args: Any, stop: threading.Event) -> None:
    kinds = list(FAULTS)
    while not stop.wait(args.storm * rng.uniform(0.6, 1.0)):
        kind = kinds.pop(0) if kinds else rng.choice(FAULTS)  # each kind once first
        try:
            cluster.fault(kind, rng, args.lease, stop)
        except Exception as exc:  # a host that cannot start again fails the verdict
            cluster.errors.append(f"{kind}: {type(exc).__name__}: {str(exc)[-1500:]}")
            cluster.note(f"the {kind} fault failed: {type(exc).__name__}")


def _load(cluster: Cluster, rng: random.Random, args: Any) -> list[CallRecord]:
    """Calls submitted to the hosts in turn for args.duration, at most
    args.concurrency in flight (a call is in flight from its submit for its
    scripted length)."""
    records: list[CallRecord] = []
    end = time.monotonic() + args.duration
    slots = threading.Semaphore(args.concurrency)
    for i in range(args.calls):
        if time.monotonic() >= end or not slots.acquire(timeout=max(0.0, end - time.monotonic())):
            break
        key = f"k{i}-{rng.randrange(1 << 30):x}"
        chunks, delay = rng.randint(10, 60), rng.choice((0.02, 0.04, 0.06))
        cluster.emu.script(key, [{"fault": "ok", "chunks": chunks, "chunk_delay_s": delay}] * 8)
        record = CallRecord(call_id="", key=key)
        records.append(record)
        request = {"model": f"gpt-emu#{key}",
                   "messages": [{"role": "user", "content": f"cluster chaos call {i}"}]}
        _submit(cluster, record, request, i)
        threading.Timer(chunks * delay, slots.release).start()
    return records


def _subscribers_view(cluster: Cluster, records: list[CallRecord], rng: random.Random,
                      sample: int) -> tuple[int, list[str]]:
    """A subscriber's view: `sample` accepted calls read from a host chosen at
    random (often not the one that ran them: any host serves any call), from
    seq 0 to the done; each must equal its log's events. (checked, differing)"""
    done = [r for r in records if r.call_id and r.events]
    differing = []
    for r in rng.sample(done, min(sample, len(done))):
        name = rng.choice(HOSTS)
        host = cluster.hosts[name]
        try:
            with host.client(timeout_s=10.0) as client:
                client.subscribe(r.call_id, from_seq=0)
                seen = list(client.events(r.call_id, timeout_s=30.0))
        except (TimeoutError, ClientError, OSError) as exc:
            differing.append(f"{r.key} on {name}: {type(exc).__name__}: {exc}"[:300]
                             + _mentions(host, r.call_id))
            continue
        if seen != r.events:
            differing.append(f"{r.key} on {name}: {len(seen)} events served (seqs "
                             f"{_ranges([e.get('seq', 0) for e in seen])}, last "
                             f"{seen[-1].get('op') if seen else None}), {len(r.events)} in the "
                             f"log" + _mentions(host, r.call_id))
    return min(sample, len(done)), differing


def _ranges(seqs: list[int]) -> str:
    """1-24,51: the runs of consecutive seqs."""
    runs: list[list[int]] = []
    for seq in seqs:
        if runs and seq == runs[-1][1] + 1:
            runs[-1][1] = seq
        else:
            runs.append([seq, seq])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


def _mentions(host: DaemonProcess, call_id: str) -> str:
    """What the host logged of the call (its last lines), to explain a differing view."""
    lines = [f"{r.get('level', r.get('levelname'))} {r.get('message')}"[:200]
             for r in host.log_records()
             if r.get("call_id") == call_id or call_id in str(r.get("message", ""))]
    return "".join(f"\n        {line}" for line in lines[-10:])


def _verdict(cluster: Cluster, records: list[CallRecord],
             served: tuple[int, list[str]] = (0, [])) -> int:
    accepted = [r for r in records if r.call_id]
    outcomes = [judge(r, cluster.emu.log(r.key)) for r in accepted]
    counts = tally(outcomes)
    unanswered = len(records) - len(accepted)
    print("\ncluster chaos (3 NATS nodes, 3 hosts; verdict from the calls' logs and the "
          "emulator's record)")
    for what, n in sorted(cluster.injected.items()):
        print(f"  injected: {what} = {n}")
    print(f"  late appends refused by the engine (frozen hosts' count) = {cluster.refused}")
    rows = [("submits answered accepted", counts["submitted"]),
            ("submits unanswered (host killed or frozen: nothing promised)", unanswered),
            ("completed", counts["completed"]), ("partial", counts["partial"]),
            ("failed", counts["failed"]), ("cancelled", counts["cancelled"])]
    rows += [(f"{k} (must be 0)", counts[k]) for k in BAD]
    width = max(len(k) for k, _ in rows)
    for k, n in rows:
        print(f"  {k:<{width}} {n:>7}")
    lost = [r for r, labels in zip(accepted, outcomes, strict=True)
            if any(bad in labels for bad in BAD)]
    for r in lost[:5]:
        print(f"  bad: {r.key} call={r.call_id} (what the emulator got: "
              f"{[(x['n'], x['completed'], x['aborted']) for x in cluster.emu.log(r.key)]})")
    if lost:
        asyncio.run(_explain(cluster.nats, lost[:5]))
        for name, host in cluster.hosts.items():
            lines = [f"{r.get('levelname', r.get('level'))} {r.get('message')}"
                     for r in host.log_records()
                     if str(r.get("level", r.get("levelname", ""))) in ("WARNING", "ERROR")]
            print(f"  {name}'s last warnings:\n    " + "\n    ".join(lines[-12:]))
    faults_ok = all(any(k in what for what in cluster.injected) for k in ("kill", "SIGSTOP",
                                                                         "NATS"))
    print(f"  every fault injected: {'yes' if faults_ok else 'no'}")
    for error in cluster.errors:
        print(f"  FAULT FAILED: {error}")
    checked, differing = served
    print(f"  a subscriber's view (from a host at random, from seq 0) equal to the log: "
          f"{checked - len(differing)} of {checked}")
    for line in differing[:5]:
        print(f"    differs: {line}")
    print(f"  every host came back: {'no' if cluster.errors else 'yes'}")
    # Every provider request ended (completed, or closed when its worker was
    # killed: a zombie's once it noticed, a killed host's with it).
    still_open = [(r.key, x["n"]) for r in records for x in cluster.emu.log(r.key)
                  if not x["ended"]]
    print(f"  provider requests still open at the end (must be 0): {len(still_open)}"
          + (f" {still_open[:5]}" if still_open else ""))
    ok = verdict_ok(counts) and counts["submitted"] > 0 and faults_ok and not cluster.errors \
        and not differing and not still_open
    print(f"  verdict: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
