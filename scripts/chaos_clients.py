"""Chaos: heavy and hostile clients, all at once, against a daemon serving normal calls.

    python -m scripts.chaos_clients [--seed N] [--calls 2000] [--duration 60]

The daemon starts with an open-files soft limit of 1,024 (it raises its own).
For --duration seconds, beside a load of normal calls (the verdict's):
- replay storms: listeners that subscribe again and again from seq 0 to a
  long finished call of their own, and never read;
- subscribers that never read, on streams of 8 MB;
- slow readers (the client library, a pause per event) on streams of 3 MB;
- giant submits (12 MB requests) and many submits (1 MB requests, pipelined);
- 2,000 idle connections: half authenticated ZeroMQ peers, half raw socket
  connections that never speak (opened again when the daemon closes them).
A well-behaved client meanwhile times `status` and `submit`. Then, with the
storm still on, the daemon gets SIGTERM.

Verdict: every normal call completes exactly; each slow reader got its
whole answer, subscribing again at most a few times; `status` and `submit`
p99 under 50 ms; the RSS of each daemon process under its bound
(docs/SECURITY.md, "Limits"); the daemon exits within stop_grace_s of
SIGTERM; and the storm really happened (the attackers' counts, and the
sink's cut-offs). Loopback only; every loop ends with --duration.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import random
import resource
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import psutil
import zmq

from scripts.chaos_common import ChaosState, chaos_run, parser, run_load, seeded, verdict
from streamfence.devtools.launcher import wait_until
from streamfence.protocol.client import Client, ClientError
from streamfence.protocol.codec import encode
from streamfence.protocol.credentials import Credentials, load_credentials
from streamfence.protocol.keys import KeyStore
from streamfence.protocol.messages import events_endpoint

MIB = 1 << 20
# The documented bounds (docs/SECURITY.md, "Limits"), per process.
RSS_BOUND = {"supervisor": 512 * MIB, "sink": 512 * MIB, "zygote": 256 * MIB,
             "worker": 256 * MIB}
P99_BOUND_S = 0.050
STOP_GRACE_S = 10.0
SLOW_WAIT_S = 60.0  # the storm goes on until each slow reader finished a call, at most this
SLOW_RESUBSCRIBES_MAX = 4


def steps(rng: random.Random) -> list[dict[str, Any]]:
    return [{"fault": "ok", "chunks": rng.randint(10, 40),
             "chunk_delay_s": rng.uniform(0.005, 0.02)}]


def options(rng: random.Random) -> dict[str, Any]:
    return {}


def _request(key: str, content: str = "hi") -> dict[str, Any]:
    return {"model": f"gpt-emu#{key}", "messages": [{"role": "user", "content": content}]}


def _submit(ref: str, key: str, listener: str | None, content: str = "hi") -> bytes:
    msg: dict[str, Any] = {"v": 1, "op": "submit", "ref": ref,
                           "call": {"provider": "emu", "request": _request(key, content)}}
    if listener is not None:
        msg["listener"] = listener
    return encode(msg)


class Raw:
    """A hostile client on raw sockets: requests, and an events connection it
    may never read."""

    def __init__(self, ctx: zmq.Context[Any], state: ChaosState, creds: Credentials) -> None:
        self.listener = uuid.uuid4().hex
        self.req = ctx.socket(zmq.DEALER)
        self.events = ctx.socket(zmq.DEALER)
        self.events.setsockopt(zmq.ROUTING_ID, self.listener.encode())
        for sock, where in ((self.req, state.daemon.endpoint),
                            (self.events, events_endpoint(state.daemon.endpoint))):
            sock.linger = 0
            sock.sndhwm = 1000
            creds.apply(sock)
            sock.connect(where)
        self.events.send(msgpack.packb({"v": 1, "op": "listen"}))

    def replies(self, timeout_ms: int = 0) -> list[dict[str, Any]]:
        out = []
        if self.req.poll(timeout_ms):
            while True:
                try:
                    out.append(msgpack.unpackb(self.req.recv(zmq.NOBLOCK)))
                except zmq.Again:
                    return out
        return out

    def close(self) -> None:
        self.req.close()
        self.events.close()


class Storm:
    def __init__(self, state: ChaosState, rng: random.Random, duration: float) -> None:
        self.state, self.rng = state, rng
        self.stop = threading.Event()
        self.stopping = threading.Event()  # SIGTERM was sent
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.ctx.max_sockets = 8192
        keys = KeyStore(state.daemon.state_dir / "keys")
        self.creds = {name: keys.register(name, state.daemon.endpoint)
                      for name in ("replayer", "silent", "slow", "giant", "many", "idle",
                                   "probe")}
        self.latency: dict[str, list[float]] = {"status": [], "submit": [], "admin status": []}
        self.slow: list[tuple[bool, int]] = []  # (answer exact, subscribes) per slow call
        self.threads: list[threading.Thread] = []
        self.duration = duration

    def spawn(self, target: Callable[..., None], *args: Any) -> None:
        t = threading.Thread(target=self._guard, args=(target, *args), daemon=True)
        self.threads.append(t)
        t.start()

    def _guard(self, target: Callable[..., None], *args: Any) -> None:
        try:
            target(*args)
        except Exception as exc:  # an attacker's failure is reported, never hidden
            if not self.stopping.is_set():  # (after SIGTERM the daemon says shutting_down)
                self.state.count(f"attacker error {type(exc).__name__}: {str(exc)[:80]}")

    # ---- the attackers -------------------------------------------------------------

    def replay_storm(self, listeners: int, deltas: int) -> None:
        key = f"long-{uuid.uuid4().hex[:8]}"
        self.state.emu.script(key, [{"fault": "ok", "chunks": deltas, "text": "t " * deltas}])
        with Client(self.state.daemon.endpoint, 120.0, credentials=self.creds["replayer"]) as c:
            call_id = c.run("emu", _request(key), timeout_s=300.0)["call_id"]
        raws = [Raw(self.ctx, self.state, self.creds["replayer"]) for _ in range(listeners)]
        try:
            while not self.stop.wait(0.002):
                raw = self.rng.choice(raws)
                try:
                    raw.req.send(msgpack.packb(
                        {"v": 1, "op": "subscribe", "ref": uuid.uuid4().hex, "call_id": call_id,
                         "from_seq": 0, "listener": raw.listener}), zmq.NOBLOCK)
                    self.state.count("replay subscribes from seq 0 (never read)")
                except zmq.Again:
                    pass
                raw.replies()
        finally:
            for raw in raws:
                raw.close()

    def silent_subscribers(self, n: int) -> None:
        raws = [Raw(self.ctx, self.state, self.creds["silent"]) for _ in range(n)]
        try:
            while not self.stop.is_set():
                for raw in raws:
                    key = f"silent-{uuid.uuid4().hex[:8]}"
                    self.state.emu.script(key, [{"fault": "ok", "chunks": 2000,
                                                 "text": "s" * (8 * MIB)}])
                    raw.req.send(_submit(uuid.uuid4().hex, key, raw.listener))
                    self.state.count("8 MB streams to subscribers that never read")
                    raw.replies()
                self.stop.wait(5.0)
        finally:
            for raw in raws:
                raw.close()

    def slow_reader(self) -> None:
        with Client(self.state.daemon.endpoint, 10.0, credentials=self.creds["slow"]) as c:
            while not self.stop.is_set():
                key = f"slow-{uuid.uuid4().hex[:8]}"
                text = "".join(chr(97 + i % 26) for i in range(1023)) * 3000
                # The same answer for a retry too (a first attempt may go stale
                # on a loaded machine before its first chunk: the emulator's
                # default answer would then be judged as the slow reader's).
                self.state.emu.script(key, [{"fault": "ok", "chunks": 3000, "text": text}] * 6)
                before = c._core.subscribes
                call_id = c.submit("emu", _request(key))
                got, done = [], {}
                for event in c.events(call_id, timeout_s=60.0):
                    if event["op"] == "delta":
                        got.append(event["data"])
                        time.sleep(0.001)  # the slow consumer itself, not a synchronization
                    elif event["op"] == "reset":
                        got.clear()  # a retry from the start: what came before is void
                    elif event["op"] == "done":
                        done = event
                if done.get("status") != "completed" and self.stopping.is_set():
                    return  # cut short by the daemon's SIGTERM: not a slow reader's result
                exact = "".join(got) == text
                if not exact:
                    print(f"  slow reader: call {call_id} {done.get('status')} after "
                          f"{done.get('attempts')} attempt(s): {sum(map(len, got))} of "
                          f"{len(text)} characters", flush=True)
                    for line in self.state.daemon.log_text().splitlines():
                        if call_id[:8] in line:
                            print(f"    daemon: {line[:300]}", flush=True)
                self.slow.append((exact, c._core.subscribes - before))
                self.state.count("slow readers' calls")

    def submits(self, who: str, size: int, pipeline: int) -> None:
        """Submits of `size` bytes, `pipeline` outstanding, as fast as answered.
        The frames are built once (this process must not spend the cores
        building them: the daemon's figures are what is measured)."""
        raw = Raw(self.ctx, self.state, self.creds[who])
        # Their answers are not judged: the emulator's default one. (A script
        # of 100,000 steps once made the emulator's loop parse them for
        # 0.8 s of CPU, seconds on the busy cores, and every stream stood
        # still meanwhile: a slow reader's attempt was fenced stale.)
        key = f"{who}-{uuid.uuid4().hex[:8]}"
        frames = [zmq.Frame(_submit(f"{who}-{i}", key, None, "g" * size))
                  for i in range(pipeline)]
        outstanding = 0
        try:
            while not self.stop.is_set():
                while outstanding < pipeline:
                    raw.req.send(frames[outstanding], copy=False)
                    outstanding += 1
                for reply in raw.replies(100):
                    outstanding -= 1
                    what = reply.get("code") if reply.get("op") == "error" else reply.get("op")
                    self.state.count(f"{size // MIB} MB submits: {what}")
        finally:
            raw.close()

    def idle_connections(self, n: int) -> None:
        """Held by a process of its own (2,000 descriptors, and its polling, out
        of this one)."""
        ctx = multiprocessing.get_context("spawn")
        results = ctx.Queue()
        stop = ctx.Event()
        creds = KeyStore(self.state.daemon.state_dir / "keys").credentials_path("idle")
        proc = ctx.Process(target=_hold_idle, daemon=True,
                           args=(self.state.daemon.endpoint, str(creds), n, stop, results))
        proc.start()
        self.stop.wait()
        stop.set()
        try:
            for what, count in results.get(timeout=30).items():
                self.state.count(what, count)
        finally:
            proc.join(timeout=10)

    # ---- the well-behaved client ------------------------------------------------------

    def probe(self) -> None:
        """Run the well-behaved client in a process of its own (this one's GIL,
        busy with the attackers, must not be in its figures)."""
        ctx = multiprocessing.get_context("spawn")
        results = ctx.Queue()
        stop = ctx.Event()
        keys = KeyStore(self.state.daemon.state_dir / "keys")
        proc = ctx.Process(target=_probe, daemon=True,
                           args=(self.state.daemon.endpoint, str(keys.credentials_path("probe")),
                                 str(self.state.daemon.credentials_path), stop, results))
        proc.start()
        self.stopping.wait()  # until SIGTERM is about to go
        stop.set()
        try:
            self.latency = results.get(timeout=30)
        finally:
            proc.join(timeout=10)


def _probe(endpoint: str, credentials: str, admin_credentials: str, stop: Any,
           results: Any) -> None:
    """A client identity's `status` every 20 ms and a submit every 100 ms, each
    timed (a timeout or an error too, as what it took); and an operator's
    `status` every 100 ms (it also waits for the sink's counters), reported."""
    latency: dict[str, list[float]] = {"status": [], "submit": [], "admin status": []}

    def timed(what: str, op: Callable[[], Any]) -> None:
        t0 = time.perf_counter()
        with contextlib.suppress(TimeoutError, ClientError):
            op()
        latency[what].append(time.perf_counter() - t0)

    with Client(endpoint, 10.0, credentials=credentials) as c, \
            Client(endpoint, 10.0, credentials=admin_credentials) as admin:
        c.status()  # connected and authenticated before timing
        admin.status()
        n = 0
        while not stop.wait(0.02):
            n += 1
            timed("status", c.status)
            if n % 5 == 0:
                key = f"probe-{n}"
                timed("submit", functools.partial(c.submit, "emu", _request(key),
                                                  subscribe=False))
                timed("admin status", admin.status)
    results.put(latency)


def _hold_idle(endpoint: str, credentials: str, n: int, stop: Any, results: Any) -> None:
    """Half authenticated ZeroMQ peers that say nothing, half raw connections
    that never speak ZMTP (the daemon closes them after its handshake time;
    they are opened again), until `stop`."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    ctx: zmq.Context[Any] = zmq.Context()
    ctx.max_sockets = n + 64
    creds = load_credentials(credentials)
    peers = []
    for _ in range(n // 2):
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        creds.apply(sock)
        sock.connect(endpoint)
        peers.append(sock)
    counts = {"idle authenticated connections": len(peers),
              "raw connections that never speak": 0}
    path = endpoint.removeprefix("ipc://")
    raw: list[socket.socket] = []
    try:
        while not stop.is_set():
            raw = [s for s in raw if _open(s)]
            while len(raw) < n - n // 2:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.setblocking(False)
                try:
                    s.connect(path)
                except OSError:
                    s.close()
                    break
                raw.append(s)
                counts["raw connections that never speak"] += 1
            stop.wait(0.5)
    finally:
        for s in raw:
            s.close()
        ctx.destroy(linger=0)
        results.put(counts)


def _open(s: socket.socket) -> bool:
    try:
        if s.recv(1, socket.MSG_PEEK) == b"":
            s.close()
            return False
    except BlockingIOError:
        return True
    except OSError:
        s.close()
        return False
    return True


def _rss(sup: int, roles: dict[int, str], peak: dict[str, int]) -> None:
    try:
        procs = [psutil.Process(sup), *psutil.Process(sup).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            rss = p.memory_info().rss
        except psutil.NoSuchProcess:
            continue
        role = roles.get(p.pid, "worker")
        peak[role] = max(peak.get(role, 0), rss)


def _p99(values: list[float]) -> float:
    if not values:
        return float("inf")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def main() -> int:
    p = parser(__doc__.split("\n\n")[0], calls=2000, duration=60.0)
    p.add_argument("--replay-deltas", type=int, default=200_000,
                   help="deltas of the long call the replay storm subscribes to")
    p.add_argument("--idle", type=int, default=2000, help="idle connections held")
    p.add_argument("--skip", default="", help="attackers left out, comma separated: "
                   "idle,replay,silent,slow,giant,many")
    args = p.parse_args()
    args.concurrency = min(args.concurrency, 8)
    rng = seeded(args)
    # Room for the many short-lived clients of the normal load and the attackers
    # (libzmq's default is 1,023 sockets per context; closed ones are reaped late).
    zmq.Context.instance().max_sockets = 8192
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))  # the daemon inherits it
    with chaos_run({"workers_max": args.workers_max, "stop_grace_s": STOP_GRACE_S}) as state:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # ours: the idle connections
        sup = state.daemon.proc.pid if state.daemon.proc else 0
        with state.daemon.client() as admin:
            roles = {pid: role for role, pid in admin.status()["processes"].items()}
        storm = Storm(state, random.Random(rng.random()), args.duration)
        peak: dict[str, int] = {}
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.wait(0.25):
                _rss(sup, roles, peak)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        skip = set(filter(None, args.skip.split(",")))
        attackers: dict[str, list[tuple[Callable[..., None], tuple[Any, ...]]]] = {
            "idle": [(storm.idle_connections, (args.idle,))],
            "replay": [(storm.replay_storm, (30, args.replay_deltas))],
            "silent": [(storm.silent_subscribers, (5,))],
            "slow": [(storm.slow_reader, ())] * 3,
            "giant": [(storm.submits, ("giant", 12 * MIB, 4))],
            "many": [(storm.submits, ("many", 1 * MIB, 20))],
        }
        for name, runs in attackers.items():
            for target, targs in runs if name not in skip else []:
                storm.spawn(target, *targs)
        args.skipped = skip
        probe = threading.Thread(target=storm.probe, daemon=True)
        probe.start()
        ticks_before = _cpu_ticks()
        run_load(state, args, rng, steps, options)
        if "slow" not in skip:
            # The storm lasts until each slow reader has finished a call (a
            # faster load must not end it before any could: "0 of 0").
            wait_until(lambda: len(storm.slow) >= len(attackers["slow"]), SLOW_WAIT_S,
                       "each slow reader to finish a call")
        ticks = [after - before for after, before in zip(_cpu_ticks(), ticks_before, strict=True)]
        steal = ticks[0] / max(1, ticks[1])
        with state.daemon.client(timeout_s=10.0) as admin:
            reply = admin.status()
        sink = dict(reply["sink"], restarts=reply["counters"].get("sink_restarts", 0))
        # SIGTERM with the storm still on.
        t0 = time.monotonic()
        stopped_in = None
        storm.stopping.set()
        probe.join(timeout=45)
        if state.daemon.proc is not None:
            state.daemon.proc.send_signal(signal.SIGTERM)
            try:
                state.daemon.proc.wait(timeout=STOP_GRACE_S + 5)
                stopped_in = time.monotonic() - t0
            except Exception:
                stopped_in = None
        storm.stop.set()
        sampling.set()
        for t in storm.threads:
            t.join(timeout=30)
        sampler.join(timeout=5)
        storm.ctx.destroy(linger=0)
        ok = verdict(state, "chaos_clients: heavy and hostile clients, all at once")
        # The machine's own noise: CPU time the hypervisor gave to others.
        print(f"  cpu steal during the storm: {steal:.1%} of this machine's time")
        checks = _checks(storm, peak, sink, stopped_in, args)
    return 0 if ok and all(checks) else 1


def _cpu_ticks() -> tuple[int, int]:
    """(stolen, all) CPU ticks since boot (/proc/stat): stolen is the time the
    hypervisor gave to other machines."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]]
    return fields[7], sum(fields)


def _checks(storm: Storm, peak: dict[str, int], sink: dict[str, Any],
            stopped_in: float | None, args: Any) -> list[bool]:
    checks = []

    def check(what: str, good: bool) -> None:
        checks.append(good)
        print(f"  {'ok  ' if good else 'FAIL'} {what}")

    print("  sink: events_cut_offs = {events_cut_offs}, replays = {replays}, "
          "events_unacked_bytes = {events_unacked_bytes}".format(**sink))
    for what in ("status", "submit", "admin status"):
        values = storm.latency[what]
        p50 = sorted(values)[len(values) // 2] if values else float("inf")
        figures = (f"{what} latency of a well-behaved client: p50 {p50 * 1000:.1f} ms, "
                   f"p99 {_p99(values) * 1000:.1f} ms over {len(values)}")
        if what == "admin status":  # an operator's: it waits for the sink's counters
            print(f"  info {figures} (not bound: it waits for the sink)")
        else:
            check(f"{figures} (bound {P99_BOUND_S * 1000:.0f} ms)", _p99(values) < P99_BOUND_S)
    for role in ("supervisor", "sink", "zygote", "worker"):
        got = peak.get(role, 0)
        check(f"peak RSS of the {role}: {got / MIB:.0f} MiB (bound {RSS_BOUND[role] // MIB} MiB)",
              0 < got <= RSS_BOUND[role])
    # A sink restart fences every running attempt (issue 13): the storm must
    # not cause one.
    check(f"the sink never restarted during the storm ({sink['restarts']} restarts)",
          sink["restarts"] == 0)
    slow_ok = [exact for exact, _ in storm.slow]
    resubs = [n for _, n in storm.slow]
    check(f"slow readers: {sum(slow_ok)} of {len(slow_ok)} answers exact, subscribes again "
          f"per call at most {max(resubs, default=0)} (bound {SLOW_RESUBSCRIBES_MAX})",
          "slow" in args.skipped
          or (bool(slow_ok) and all(slow_ok) and max(resubs) <= SLOW_RESUBSCRIBES_MAX))
    check(f"SIGTERM during the storm: exited in "
          f"{'never' if stopped_in is None else f'{stopped_in:.1f} s'} (stop_grace_s "
          f"{STOP_GRACE_S:g})", stopped_in is not None and stopped_in <= STOP_GRACE_S)
    faults = storm.state.faults
    skip = args.skipped
    check("the storm happened (replay subscribes, cut-offs, refused giant submits, "
          f"{args.idle} idle connections; skipped: {','.join(sorted(skip)) or 'none'})",
          ("replay" in skip or faults.get("replay subscribes from seq 0 (never read)", 0) > 0)
          and ("silent" in skip or sink["events_cut_offs"] > 0)
          and ("giant" in skip or any(k.startswith("12 MB submits: ")
                                      and not k.endswith("accepted") for k in faults))
          and ("idle" in skip or faults.get("idle authenticated connections", 0)
               + faults.get("raw connections that never speak", 0) >= args.idle)
          and not any(k.startswith("attacker error") for k in faults))
    if not all(checks):  # what the daemon said of it
        errors = [line for line in storm.state.daemon.log_text().splitlines()
                  if " ERROR " in line or " CRITICAL " in line]
        for line in errors[:30]:
            print(f"    daemon: {line[:300]}")
    print(f"  verdict (limits): {'PASS' if all(checks) else 'FAIL'}")
    return checks


if __name__ == "__main__":
    sys.exit(main())
