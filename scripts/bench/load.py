"""Load processes shared by sections 2, 3 and 5: producers that impersonate
workers on the internal wire, the machine's ceiling server, and a standalone
sink with a control link that authorizes calls as the supervisor does.

Producers are persistent processes (spawned once per section; they import
only zmq and msgpack) driven over a ROUTER socket of the bench:

    bench -> producer  ["blast", endpoint, calls, attempt, per_call, data]
                       pre-pack T_DELTA frames (calls interleaved), connect
                       (a stream path: as a worker does; an ipc:// endpoint: a
                       DEALER with SNDHWM 0), answer "ready",
                       wait for "go", send them all, then one T_FINAL per call,
                       wait for every T_FINAL_ACK, answer
                       ["done", t0_ns, t1_ns, acked, refused]
    bench -> producer  ["paced", endpoint, call, attempt, first_seq, rate, seconds, pad]
                       after "go", send T_DELTA frames at `rate`/s whose data is
                       the CLOCK_MONOTONIC ns of the send (19 digits) + pad,
                       stamped just before each send; answer ["done", t0, t1, sent]
    bench -> producer  ["exit"]

Pacing: the producer sends what is due (rate x elapsed) and sleeps ~0.1 ms, so
frames leave in small bursts of a few, each stamped at its own send.

The ceiling server (`ceiling_main`) is the sink with everything but the
transport, the decode and the store taken out: ROUTER, `msgpack.unpackb`, and
(with a db path) one row per delta in SQLite WAL, synchronous=NORMAL, group
commit every 1000 rows or when the input runs dry (at most once per ms) or
5 ms after the first pending row; a final is acked after the commit covering it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sqlite3
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import multiprocess
import zmq

from streamfence.protocol.internal import (
    C_AUTHORIZE,
    C_STATS,
    C_SUBSCRIBE,
    R_OK,
    T_DELTA,
    T_FINAL,
    T_FINAL_ACK,
    Endpoints,
)
from streamfence.protocol.internal.outcome import AttemptOutcome, outcome_to_wire
from streamfence.protocol.messages import events_endpoint
from streamfence.workers.sink_channel import SinkChannel

_FINAL_OK = outcome_to_wire(AttemptOutcome(ok=True, finish_reason="stop", model="bench"))
ACK_TIMEOUT_S = 120.0


# ---- producer process ------------------------------------------------------------

def producer_main(ctl_endpoint: str, ident: bytes) -> None:
    ctx = zmq.Context()
    ctl = ctx.socket(zmq.DEALER)
    ctl.linger = 0
    ctl.setsockopt(zmq.IDENTITY, ident)
    ctl.connect(ctl_endpoint)
    ctl.send(msgpack.packb(["hello"]))
    try:
        while True:
            msg = msgpack.unpackb(ctl.recv())
            if msg[0] == "exit":
                break
            if msg[0] == "blast":
                _blast(ctx, ctl, *msg[1:])
            elif msg[0] == "paced":
                _paced(ctx, ctl, *msg[1:])
    finally:
        ctl.close()
        ctx.term()


class _Wire:
    """A producer's end of the worker wire: the sink's stream socket (a path,
    as workers use: streamfence.workers.sink_channel) or a ZeroMQ endpoint (the
    ceiling server, the sink's `sink.in` door): a DEALER with no HWM, as a worker
    once used."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str) -> None:
        self._channel: SinkChannel | None = None
        self._sock: zmq.Socket[bytes] | None = None
        if endpoint.startswith("ipc://"):
            self._sock = ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.SNDHWM, 0)
            self._sock.connect(endpoint)
            self.send = self._sock.send
        else:
            self._channel = SinkChannel(endpoint)
            self.send = self._channel.send

    def reply(self, timeout_s: float) -> Any | None:
        if self._channel is not None:
            return self._channel.wait_reply(timeout_s)
        assert self._sock is not None
        return msgpack.unpackb(self._sock.recv()) if self._sock.poll(int(timeout_s * 1000)) \
            else None

    def close(self) -> None:
        if self._channel is not None:
            self._channel.wait_reply(0.2)  # writes what is still queued
            self._channel.close()
        if self._sock is not None:
            time.sleep(0.2)  # linger 0: let the io thread flush before the socket goes
            self._sock.close()


def _blast(ctx: zmq.Context[Any], ctl: zmq.Socket[bytes], endpoint: str, calls: list[str],
           attempt: int, per_call: int, data: str) -> None:
    pack = msgpack.Packer(use_bin_type=True).pack
    frames = [pack([T_DELTA, call, attempt, seq, "text", data])
              for seq in range(1, per_call + 1) for call in calls]
    finals = [pack([T_FINAL, call, attempt, per_call, _FINAL_OK]) for call in calls]
    sock = _Wire(ctx, endpoint)
    ctl.send(msgpack.packb(["ready"]))
    msgpack.unpackb(ctl.recv())  # "go"
    send = sock.send
    t0 = time.monotonic_ns()
    for frame in frames:
        send(frame)
    for frame in finals:
        send(frame)
    acked = refused = 0
    deadline = time.monotonic() + ACK_TIMEOUT_S
    while acked + refused < len(calls) and time.monotonic() < deadline:
        reply = sock.reply(1.0)
        if reply is None:
            continue
        if reply[0] == T_FINAL_ACK:
            if reply[3]:
                acked += 1
            else:
                refused += 1
    t1 = time.monotonic_ns()
    sock.close()
    ctl.send(msgpack.packb(["done", t0, t1, acked, refused]))


def _paced(ctx: zmq.Context[Any], ctl: zmq.Socket[bytes], endpoint: str, call: str,
           attempt: int, first_seq: int, rate: float, seconds: float, pad: str) -> None:
    pack = msgpack.Packer(use_bin_type=True).pack
    sock = _Wire(ctx, endpoint)
    ctl.send(msgpack.packb(["ready"]))
    msgpack.unpackb(ctl.recv())  # "go"
    send, now_ns, sleep = sock.send, time.monotonic_ns, time.sleep
    total = int(rate * seconds)
    seq = first_seq
    sent = 0
    t0 = now_ns()
    while sent < total:
        due = min(total, int((now_ns() - t0) * rate / 1e9) + 1)
        while sent < due:
            send(pack([T_DELTA, call, attempt, seq, "text", f"{now_ns():019d}{pad}"]))
            seq += 1
            sent += 1
        sleep(0.0001)
    t1 = now_ns()
    sock.close()
    ctl.send(msgpack.packb(["done", t0, t1, sent]))


class Producers:
    """k producer processes and the bench's end of their control socket."""

    def __init__(self, count: int, runtime_dir: str) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context.instance()
        self.sock: zmq.Socket[bytes] = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        endpoint = "ipc://" + os.path.join(runtime_dir, "producers")
        self.sock.bind(endpoint)
        mp = multiprocess.get_context("spawn")
        self.idents = [b"p%d" % i for i in range(count)]
        self.procs = [mp.Process(target=producer_main, args=(endpoint, ident), daemon=True)
                      for ident in self.idents]
        for proc in self.procs:
            proc.start()
        seen: set[bytes] = set()
        while len(seen) < count:
            if not self.sock.poll(30_000):
                raise RuntimeError("producer processes did not say hello within 30 s")
            ident, _ = self.sock.recv_multipart()
            seen.add(ident)

    def run(self, jobs: list[list[Any]], extra: dict[zmq.Socket[bytes],
            Callable[[zmq.Socket[bytes]], None]] | None = None,
            timeout_s: float = 180.0) -> list[list[Any]]:
        """Give job i to producer i, start them together, return their "done" replies
        (in producer order). `extra` sockets are drained by their handlers meanwhile."""
        users = self.idents[:len(jobs)]
        for ident, job in zip(users, jobs, strict=True):
            self.sock.send_multipart([ident, msgpack.packb(job, use_bin_type=True)])
        self._collect(users, "ready", extra, timeout_s)
        for ident in users:
            self.sock.send_multipart([ident, msgpack.packb(["go"])])
        done = self._collect(users, "done", extra, timeout_s)
        return [done[ident] for ident in users]

    def _collect(self, users: list[bytes], what: str,
                 extra: dict[zmq.Socket[bytes], Callable[[zmq.Socket[bytes]], None]] | None,
                 timeout_s: float) -> dict[bytes, list[Any]]:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        for sock in extra or {}:
            poller.register(sock, zmq.POLLIN)
        got: dict[bytes, list[Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < len(users):
            if time.monotonic() > deadline:
                raise RuntimeError(f"producers did not report {what!r} within {timeout_s:.0f} s")
            for sock, _ in poller.poll(100):
                if sock is self.sock:
                    ident, body = self.sock.recv_multipart()
                    msg = msgpack.unpackb(body)
                    if msg[0] == what:
                        got[ident] = msg
                elif extra is not None:
                    extra[sock](sock)
        return got

    def close(self) -> None:
        for ident in self.idents:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.send_multipart([ident, msgpack.packb(["exit"])])
        for proc in self.procs:
            proc.join(timeout=5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=2.0)
        self.sock.close(linger=0)


# ---- ceiling server -----------------------------------------------------------------

def ceiling_main(endpoint: str, db_path: str | None) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.RCVHWM, 10_000)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    conn = None
    if db_path is not None:
        conn = sqlite3.connect(db_path, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("CREATE TABLE IF NOT EXISTS ev (call TEXT, seq INTEGER, data TEXT)")
    rows: list[tuple[str, int, str]] = []
    finals: list[tuple[bytes, bytes]] = []
    first_pending = 0.0
    last_commit = 0.0
    unpackb = msgpack.unpackb
    pack = msgpack.Packer(use_bin_type=True).pack
    recv = sock.recv
    while True:
        timeout = 1000 if not (rows or finals) else 1
        if not sock.poll(timeout):
            idle = True
        else:
            idle = False
            for _ in range(1000 - len(rows)):
                try:
                    ident = recv(zmq.NOBLOCK)
                except zmq.Again:
                    idle = True
                    break
                msg = unpackb(recv())
                if msg[0] == T_DELTA:
                    rows.append((msg[1], msg[3], msg[5]))
                elif msg[0] == T_FINAL:
                    finals.append((ident, pack([T_FINAL_ACK, msg[1], msg[2], True, ""])))
        if not (rows or finals):
            continue
        now = time.monotonic()
        if not first_pending:
            first_pending = now
        if (len(rows) >= 1000 or now - first_pending >= 0.005
                or (idle and now - last_commit >= 0.001)):
            if conn is not None and rows:
                conn.execute("BEGIN")
                conn.executemany("INSERT INTO ev VALUES (?, ?, ?)", rows)
                conn.execute("COMMIT")
            rows = []
            for ident, ack in finals:
                sock.send_multipart([ident, ack])
            finals = []
            first_pending = 0.0
            last_commit = now


@contextlib.contextmanager
def ceiling(runtime_dir: str, name: str, with_db: bool) -> Iterator[str]:
    """A ceiling server process; yields its endpoint."""
    endpoint = "ipc://" + os.path.join(runtime_dir, name)
    db = os.path.join(runtime_dir, name + ".db") if with_db else None
    proc = multiprocess.get_context("spawn").Process(target=ceiling_main, args=(endpoint, db),
                                                     daemon=True)
    proc.start()
    try:
        _wait_path(endpoint[len("ipc://"):], proc)
        yield endpoint
    finally:
        proc.kill()
        proc.join(timeout=5.0)


def _wait_path(path: str, proc: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if not proc.is_alive():
            raise RuntimeError(f"process {proc.name} exited with {proc.exitcode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear within {timeout_s:.0f} s")
        time.sleep(0.01)


# ---- standalone sink ---------------------------------------------------------------------

def _events_in(frame: bytes) -> int:
    """How many events an events-socket frame holds (its array header, or 1)."""
    head = frame[0]
    if 0x90 <= head <= 0x9f:
        return head - 0x90
    if head == 0xdc:
        return int.from_bytes(frame[1:3], "big")
    if head == 0xdd:
        return int.from_bytes(frame[1:5], "big")
    return 1


def _run_sink_of(tree: str, *args: Any) -> None:
    """A sink process running the streamfence of another source tree (an A/B
    baseline): what this process imported of ours is forgotten first."""
    import sys

    for name in [m for m in sys.modules if m == "streamfence" or m.startswith("streamfence.")]:
        del sys.modules[name]
    sys.path.insert(0, tree)
    from streamfence.sink.process import run_sink

    run_sink(*args)


class SinkUnderTest:
    """The real sink process (`streamfence.sink.process.run_sink`, spawned as the daemon does,
    with a secret control identity), a control link that plays the
    supervisor (authorize and subscribe, stats), and one listener on the
    sink's events socket that every authorized call's events go to (counted,
    or handed to `on_event`). With `tree`, the sink of that source tree
    (a baseline measured beside this tree's)."""

    def __init__(self, runtime_dir: str, log_level: str = "WARNING",
                 tree: str | None = None) -> None:
        from streamfence.sink.process import run_sink

        self.endpoints = Endpoints(runtime_dir)
        identity = b"bench-" + secrets.token_hex(8).encode()
        args = (runtime_dir, os.path.join(runtime_dir, "transcript.db"),
                events_endpoint("ipc://" + os.path.join(runtime_dir, "front")), None,
                log_level, identity)
        self.proc = multiprocess.get_context("spawn").Process(
            target=run_sink if tree is None else _run_sink_of, name="sink",
            args=args if tree is None else (tree, *args), daemon=True)
        self.proc.start()
        _wait_path(self.endpoints.sink_ctl[len("ipc://"):], self.proc)
        _wait_path(self.endpoints.sink_in[len("ipc://"):], self.proc)
        self.ctl: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self.ctl.setsockopt(zmq.LINGER, 0)
        self.ctl.setsockopt(zmq.RCVHWM, 0)
        self.ctl.setsockopt(zmq.SNDHWM, 0)
        self.ctl.setsockopt(zmq.IDENTITY, identity)  # the sink obeys only this peer
        self.ctl.connect(self.endpoints.sink_ctl)
        self.listener = "bench-" + secrets.token_hex(8)
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, self.listener.encode())
        self.sock.connect(events_endpoint("ipc://" + os.path.join(runtime_dir, "front")))
        self.sock.send(msgpack.packb({"v": 1, "op": "listen"}))
        if not self.sock.poll(30_000):
            raise RuntimeError("the sink's events socket did not answer listen within 30 s")
        self.read: int = len(self.sock.recv())  # bytes read since `listen`, and acknowledged
        self._acked: int = 0
        self.events: int = 0
        self.on_event: Callable[[bytes, int], None] | None = None
        self._req: int = 0

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def drain(self, sock: zmq.Socket[bytes]) -> None:
        """Take every frame waiting on the listener (one event map, or a batch:
        an array of them): the events counted (from the frame's first bytes,
        as a subscriber that only counts would), each frame handed to
        `on_event` with the receive time."""
        recv, now_ns = self.sock.recv, time.monotonic_ns
        handler = self.on_event
        while True:
            try:
                frame = recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.read += len(frame)
            self.events += _events_in(frame)
            if handler is not None:
                handler(frame, now_ns())
        if self.read - self._acked >= 64 << 10:  # flow control (PROTOCOL §5)
            self._acked = self.read
            self.sock.send(msgpack.packb({"v": 1, "op": "ack", "read": self.read}))

    def request(self, msg: list[Any], timeout_s: float = 30.0) -> list[Any]:
        self._req += 1
        req = self._req
        self.ctl.send(msgpack.packb([msg[0], req, *msg[1:]], use_bin_type=True))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.ctl.poll(100):
                continue
            reply = msgpack.unpackb(self.ctl.recv())
            if reply[1] == req:
                return list(reply)
        raise RuntimeError(f"no reply from the sink to {msg[0]} within {timeout_s:.0f} s")

    def authorize(self, calls: list[str], attempt: int = 1) -> None:
        """Authorize each call, with the listener following it (as a submit that subscribes)."""
        for call in calls:
            for msg in ([C_SUBSCRIBE, call, self.listener, 0, True, ["bench", 0, 0]],
                        [C_AUTHORIZE, call, attempt, False]):
                reply = self.request(msg)
                if reply[0] != R_OK:
                    raise RuntimeError(f"the sink refused {msg[0]} of {call}: {reply}")

    def stats(self) -> dict[str, Any]:
        reply = self.request([C_STATS])
        return dict(reply[2])

    def close(self) -> None:
        self.ctl.close(linger=0)
        self.sock.close(linger=0)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout=10.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=2.0)
