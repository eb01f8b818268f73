"""Section 3: latency added from a worker's send to a subscriber's receive.

A producer process (scripts.bench.load, "paced") impersonates a worker: it
sends T_DELTA frames at 20k/s whose data is the CLOCK_MONOTONIC ns taken
just before the send (CLOCK_MONOTONIC is system-wide on Linux); the receiver
takes the clock right after its `recv`, before decoding. Two paths, in
rotated order each round:

- `hop`     the floor: worker -> a bare ROUTER in this process (one ZeroMQ
            ipc hop and a msgpack decode, nothing else);
- `sink`    worker -> real sink (spawned alone) -> a listener on its events
            socket: this process, which authorized and subscribed the call
            as the supervisor does;
- `daemon`  worker -> the real daemon's sink -> a subscriber (the listener
            of a client in this process that submitted the call; the
            supervisor is not on this path), on the ZeroMQ events socket,
            as a client on another host has it;
- `link`    the same, the events on the local link the sink offers (PROTOCOL
            §5 "Local links"), as the library's client on this host has
            them: attached by its own `LocalEvents.attach`. The call is
            real: the emulator holds its stream silent (`stall`, 0 chunks), so
            its worker sends nothing while the producer writes into the sink's
            `sink.in` as attempt 1 with seq 1, 2, ... like the worker would.
            After the run the call is cancelled (fenced, worker killed).

Both include the sink's durability rule: an event goes out only after the
commit that stored it. The first 5 % of each run is discarded as warm-up.

With `SF_BENCH_BASE=TREE` in the environment, `base` is the `sink` path
with the sink of that source tree (a checkout of the commit to compare
with), in the same rotation: an A/B in one run.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from scripts.bench.common import (
    Section,
    daemon,
    emulator,
    log,
    median,
    percentile,
    providers_for,
    rotated,
    sink_in_endpoint,
)
from scripts.bench.load import Producers, SinkUnderTest
from streamfence.devtools.emulator.control import EmulatorProcess
from streamfence.devtools.launcher import DaemonProcess
from streamfence.protocol.client_base import new_ref, submit_msg
from streamfence.protocol.client_local import LocalEvents
from streamfence.protocol.codec import DEFAULT_MAX_FRAME, encode
from streamfence.protocol.credentials import load_credentials
from streamfence.protocol.messages import events_endpoint

RATE = 20_000
VARIANTS = ("hop", "sink", "daemon", "link")
PAD = "abcde"
TARGET_P99_S = 0.001


class StalledCall:
    """A real call whose provider stream is held silent, and its raw subscriber."""

    def __init__(self, proc: DaemonProcess, emu: EmulatorProcess, link: bool = False) -> None:
        self.proc = proc
        key = f"lat-{uuid.uuid4().hex[:10]}"
        emu_client = emu.client()
        emu_client.script(key, [{"fault": "stall", "after": 0, "stall_s": 600}])
        creds = load_credentials(proc.credentials_path)
        listener = new_ref()
        # Requests on the client endpoint; the events on the events socket.
        self.req: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, listener.encode())
        self.sock.setsockopt(zmq.RCVHWM, 0)
        pairs: list[tuple[zmq.Socket[bytes], str]] = [(self.req, proc.endpoint),
                                                       (self.sock, events_endpoint(proc.endpoint))]
        for sock, where in pairs:
            sock.setsockopt(zmq.LINGER, 0)
            creds.apply(sock)
            sock.connect(where)
        self.sock.send(encode({"v": 1, "op": "listen"}))
        if not self.sock.poll(10_000):
            raise RuntimeError("no answer to listen on the events socket")
        listening = msgpack.unpackb(self.sock.recv())
        # With `link`, the events come on the sink's local link (acks stay here).
        self.link: socket.socket | None = None
        if link:
            local = LocalEvents.attach(listening.get("link"), DEFAULT_MAX_FRAME)
            if local is None:
                raise RuntimeError(f"no local link taken from {listening!r}")
            self.link = socket.socket(fileno=os.dup(local.fileno()))
            local.close()
            self.link.setblocking(False)
            self.unpacker: msgpack.Unpacker = msgpack.Unpacker()
        self.req.send(encode(submit_msg(new_ref(), "oa", {"model": f"m#{key}", "messages": []},
                                        session_id=None, idempotency_key=None,
                                        options={"stale_timeout_s": 600.0}, listener=listener)))
        if not self.req.poll(10_000):
            raise RuntimeError("no reply to the submit")
        reply = msgpack.unpackb(self.req.recv())
        if reply.get("op") != "accepted":
            raise RuntimeError(f"submit refused: {reply}")
        self.call_id: str = reply["call_id"]
        # The worker has the attempt once the emulator sees its request.
        emu_client.wait_for(lambda recs: recs, timeout=30.0, what="the stalled request", key=key)
        self.latencies: list[int] = []
        self.read: int = 0  # bytes read since the listen
        self.acked: int = 0  # of which acknowledged

    ACK_EVERY = 256 << 10  # as a client does (flow control, PROTOCOL §5): or it is cut off

    def drain(self, sock: zmq.Socket[bytes]) -> None:
        recv, unpackb, now_ns = sock.recv, msgpack.unpackb, time.monotonic_ns
        while True:
            try:
                frame = recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            now = now_ns()
            self.read += len(frame)
            self._stamp(unpackb(frame), now)
            self._ack()

    def drain_link(self, _fd: int) -> None:
        """Drain the local link (zmq's poller names it by its descriptor)."""
        assert self.link is not None
        recv, now_ns, unpacker = self.link.recv, time.monotonic_ns, self.unpacker
        while True:
            try:
                data = recv(1 << 18)
            except BlockingIOError:
                return
            now = now_ns()
            if not data:
                raise RuntimeError("the sink closed the local link")
            self.read += len(data)
            unpacker.feed(data)
            for got in unpacker:
                self._stamp(got, now)
            self._ack()

    def _stamp(self, got: Any, now: int) -> None:
        for event in got if isinstance(got, list) else [got]:  # a batch, or one event
            if event.get("op") == "delta":
                self.latencies.append(now - int(event["data"][:19]))

    def _ack(self) -> None:
        if self.read - self.acked >= self.ACK_EVERY:
            self.sock.send(encode({"v": 1, "op": "ack", "read": self.read}))
            self.acked = self.read

    def close(self) -> None:
        with self.proc.client(timeout_s=10.0) as client:
            client.cancel(self.call_id)
        if self.link is not None:
            self.link.close()
        self.sock.close(linger=0)
        self.req.close(linger=0)


def _hop_into(out: list[int]) -> Callable[[zmq.Socket[bytes]], None]:
    """Drain for the bare ZeroMQ hop: [identity, T_DELTA frame] from the producer."""
    def drain(sock: zmq.Socket[bytes]) -> None:
        recv, unpackb, now_ns = sock.recv, msgpack.unpackb, time.monotonic_ns
        while True:
            try:
                recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            frame = recv()
            now = now_ns()
            out.append(now - int(unpackb(frame)[5][:19]))
    return drain


def _stamps_into(out: list[int]) -> Callable[[bytes, int], None]:
    """Handler of the sink's events (a public event map's bytes) + receive time."""
    def on_event(frame: bytes, now: int) -> None:
        got = msgpack.unpackb(frame)
        for event in got if isinstance(got, list) else [got]:  # a batch, or one event
            out.append(now - int(event["data"][:19]))
    return on_event


def _summary(samples: list[int]) -> tuple[float, float, float, int]:
    kept = sorted(samples[len(samples) // 20:])
    return (percentile(kept, 50) / 1e9, percentile(kept, 99) / 1e9, kept[-1] / 1e9
            if kept else float("nan"), len(kept))


def run(quick: bool, rounds: int) -> Section:
    sec = Section("latency", "3 latency")
    seconds = 0.5 if quick else 3.0
    sec.params = {"rounds": rounds, "rate": RATE, "seconds per run": seconds}
    base_tree = os.environ.get("SF_BENCH_BASE")
    variants = (*VARIANTS, "base") if base_tree else VARIANTS
    if base_tree:
        sec.params["base tree"] = base_tree
    results: dict[str, list[tuple[float, float, float, int]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="sfbench-") as rt, emulator() as emu, \
            daemon(providers_for(emu, stale_timeout_s=600.0), {"workers_spare": 2}) as proc:
        sink = SinkUnderTest(rt)
        base = None
        if base_tree:
            os.mkdir(os.path.join(rt, "base"))
            base = SinkUnderTest(os.path.join(rt, "base"), tree=base_tree)
        producers = Producers(1, rt)
        daemon_sink_in = sink_in_endpoint(proc)
        hop: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        hop.linger = 0
        hop_endpoint = "ipc://" + rt + "/hop"
        hop.bind(hop_endpoint)
        wal = proc.state_dir / "transcript.db-wal"
        try:
            for r in range(rounds):
                for variant in rotated(variants, r):
                    samples: list[int] = []
                    if variant == "hop":
                        drain = _hop_into(samples)
                        producers.run([["paced", hop_endpoint, "hop", 1, 1, RATE, seconds, PAD]],
                                      {hop: drain})
                        _settle({hop: drain})
                    elif variant in ("sink", "base"):
                        one = base if variant == "base" and base is not None else sink
                        call = f"lat-{uuid.uuid4().hex[:12]}"
                        one.authorize([call])
                        one.on_event = _stamps_into(samples)
                        producers.run([["paced", one.endpoints.sink_stream, call, 1, 1, RATE,
                                        seconds, PAD]], {one.sock: one.drain})
                        _settle({one.sock: one.drain})
                        one.on_event = None
                    else:
                        stalled = StalledCall(proc, emu, link=variant == "link")
                        drains: dict[Any, Any] = {stalled.sock: stalled.drain}
                        if stalled.link is not None:
                            drains[stalled.link.fileno()] = stalled.drain_link
                        try:
                            producers.run([["paced", daemon_sink_in, stalled.call_id, 1, 1, RATE,
                                            seconds, PAD]], drains)
                            _settle(drains)
                        finally:
                            stalled.close()
                        samples.extend(stalled.latencies)
                    expected = int(RATE * seconds)
                    if len(samples) != expected:
                        raise RuntimeError(f"latency/{variant}: received {len(samples)} of "
                                           f"{expected} deltas")
                    results[variant].append(_summary(samples))
                log(f"  latency round {r + 1}/{rounds}: " + ", ".join(
                    f"{v} p50 {results[v][-1][0] * 1e6:.0f} µs p99 {results[v][-1][1] * 1e6:.0f} µs"
                    for v in results))
            # All of the section's deltas went through this sink: its WAL is
            # rewound once past 64 MiB (sink/store.py), or it grows with the load.
            sec.note(f"- the daemon's transcript.db-wal after the section: "
                     f"{wal.stat().st_size / 2**20:.1f} MiB (rewound "
                     f"{_sink_stats(proc).get('wal_rewinds', 0)} times)")
        finally:
            hop.close(linger=0)
            producers.close()
            sink.close()
            if base is not None:
                base.close()
    _report(sec, results)
    return sec


def _sink_stats(proc: DaemonProcess) -> dict[str, Any]:
    with proc.client(timeout_s=10.0) as client:
        sink: dict[str, Any] = client.status().get("sink") or {}
    return sink


def _settle(extra: dict[zmq.Socket[bytes], Any], seconds: float = 0.15) -> None:
    """Keep draining for a moment after the producer's last send."""
    poller = zmq.Poller()
    for sock in extra:
        poller.register(sock, zmq.POLLIN)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for sock, _ in poller.poll(20):
            extra[sock](sock)


def _report(sec: Section, results: dict[str, list[tuple[float, float, float, int]]]) -> None:
    names = {"hop": "worker → one ZeroMQ ipc hop (the machine's floor)",
             "sink": "worker → a lone sink → a listener",
             "base": f"the same, the sink of {sec.params.get('base tree')}",
             "daemon": "worker → the daemon's sink → subscriber",
             "link": "worker → the daemon's sink → a local client's link"}
    for variant, runs in results.items():
        p50 = median([x[0] for x in runs])
        p99 = median([x[1] for x in runs])
        worst = max(x[2] for x in runs)
        text = f"p50 {p50 * 1e6:.0f} µs, p99 {p99 * 1e6:.0f} µs, max {worst * 1e3:.2f} ms"
        if variant in ("daemon", "link"):
            sec.row(f"{names[variant]} @ {RATE // 1000}k/s", text, "p99 ≤ 1 ms",
                    "ref: one hop p50 ~40–60 µs, p99 ~90–175 µs", p99 <= TARGET_P99_S)
        else:
            sec.row(f"{names[variant]} @ {RATE // 1000}k/s", text, "",
                    "ref: one hop p50 ~40–60 µs, p99 ~90–175 µs")
        sec.note(f"- {names[variant]}: per-round p99 " + ", ".join(
            f"{x[1] * 1e6:.0f}" for x in runs) + f" µs over {runs[0][3]:,} samples each")
