"""The sink process: the only writer of the transcript.

`run_sink` is the entry point the supervisor starts
(supervisor/sinkchild.py: `Process(target=run_sink, ...)`, spawned). `Sink`
owns the sockets, the signals and the loop. The sink:

- reads the worker wire: the `sink.stream` AF_UNIX connections
  (sink/streams.py) and ROUTER `sink.in` (the same messages as ZeroMQ
  frames, for tests and tools), through `intake.WorkerIntake`, which holds
  the per-delta hot path (protocol/internal/worker_wire.py: T_DELTA,
  T_FINAL, T_HELLO);
- reads ROUTER `sink.ctl`, the supervisor's control ops (every op of
  protocol/internal/control.py: C_AUTHORIZE, C_FENCE, C_REBIND, C_FINISH,
  C_STATS, C_SUBSCRIBE, C_ADOPT, C_FOLLOW), refusing any other peer
  (sink/peer.py), and hands each to `SinkState.handle_control`;
- serves the public events socket (sink/subscribers.py) and the replays
  (sink/replays.py); in cluster mode, the followed calls' records
  (sink/replica.py);
- commits (sink/commits.py) when `COMMIT_EVERY` events are pending,
  `COMMIT_AFTER_S` after the first, or as soon as the input runs dry; what
  a commit stores is sent after it (durable before visible);
- prunes one retention batch when `Retention.due` has come
  (sink/retention.py);
- waits out storage faults (a full disk, an I/O error, a lock held past the
  busy timeout: docs/ARCHITECTURE.md §4.15) inside the store's commit,
  through `_pause`: it answers C_STATS meanwhile (status shows the
  fault), holds every other control op for the loop, in order, and tells
  the store when a stop was asked; in cluster mode the calls' logs are
  never waited for: what must follow a call's runs in its log waits in
  sink/log_queue.py while the loop goes on (its tries again are the
  loop's timers; past its bound the loop stops reading the workers), and a
  stop waits up to `timeout_s` for the appends in flight;
- dies with its parent (PR_SET_PDEATHSIG) and exits cleanly on SIGTERM after a
  last commit (given up, in one ERROR line, if the store is in a storage
  fault). SIGINT and SIGHUP are ignored: the supervisor owns the shutdown order.

Bad input never crashes it: refused deltas and bad frames are counted and
logged sparsely (sink/counters.py).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import signal
import socket
import sys
import time
from collections import deque
from types import FrameType
from typing import Any

import zmq

from streamfence.cluster.settings import ClusterSettings
from streamfence.protocol.codec import decode_untrusted
from streamfence.protocol.errors import ProtocolError
from streamfence.protocol.internal import Endpoints
from streamfence.protocol.internal.checks import BadFrame
from streamfence.protocol.internal.control import (
    ControlOp,
    Stats,
    encode_ok,
    encode_refused,
    parse_control,
)
from streamfence.protocol.keys import KeyStore
from streamfence.protocol.lifecycle import (
    ExitCode,
    die_with_parent,
    expected_parent_pid,
    set_process_title,
)
from streamfence.protocol.logs import route_logs_to
from streamfence.sink.commits import COMMIT_AFTER_S, COMMIT_EVERY
from streamfence.sink.intake import WorkerIntake
from streamfence.sink.links import Links
from streamfence.sink.peer import SupervisorPeer
from streamfence.sink.routers import resync, router, send
from streamfence.sink.state import SinkState
from streamfence.sink.store import StoreStopped, TranscriptStore
from streamfence.sink.streams import WorkerStreams
from streamfence.sink.subscribers import Subscribers

log = logging.getLogger("streamfence.sink")

CTL_BURST = 100
IDLE_POLL_MS = 60_000  # nothing due: the loop is event driven (signals wake it)


class Sink:
    """Owns the worker and control sockets, the loop and signal handling;
    `intake` reads the worker wire (the per-delta hot path), `state`
    (SinkState) holds the fence, the calls, the store, the commit schedule
    and the counters, `peer` (SupervisorPeer) what goes to the supervisor,
    `subscribers` the events socket."""

    def __init__(self, runtime_dir: str, db_path: str, events_endpoint: str,
                 keys_dir: str | None = None, control_identity: bytes | None = None,
                 retention_days: float = 0.0, cluster: ClusterSettings | None = None) -> None:
        ep = Endpoints(runtime_dir)
        self.ctx = zmq.Context()
        self.sin = router(self.ctx, ep.sink_in)
        self.streams = WorkerStreams(ep.sink_stream)
        self.ctl = router(self.ctx, ep.sink_ctl)
        self.peer = SupervisorPeer(self.ctl, control_identity)
        self._links = Links(ep.events_link)  # the subscribers own and close it
        self.subscribers = Subscribers(self.ctx, events_endpoint,
                                       KeyStore(keys_dir) if keys_dir is not None else None,
                                       links=self._links)
        self._signals: list[int] = []
        self._stopping = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        # Control ops that came while the store waited out a storage fault.
        self._held: deque[tuple[bytes, ControlOp]] = deque()
        self._ready = False  # `state` is built
        cluster_log = None
        if cluster is not None:
            from streamfence.sink.cluster_log import ClusterLog  # brings nats: cluster mode only

            cluster_log = ClusterLog(cluster)
        self.state = SinkState(TranscriptStore(db_path, pause=self._pause), self.peer,
                               self.subscribers, retention_days, cluster_log)
        self.intake = WorkerIntake(self.sin, self.streams, self.state)
        self._ready = True

    # ---- loop -------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals.append(signum)  # only enqueue; the loop acts on it

    def serve(self) -> None:
        signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        poller = zmq.Poller()
        poller.register(self.ctl, zmq.POLLIN)
        poller.register(self.sin, zmq.POLLIN)
        poller.register(self.subscribers.socket, zmq.POLLIN)
        streams_fd = self.streams.fileno()
        poller.register(streams_fd, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        wake_fd = self._wake_r.fileno()
        checks = self.subscribers.key_checks
        keys_fd = checks.fileno() if checks is not None else None
        if keys_fd is not None:  # `keys/clients/` changed: look for revoked keys
            poller.register(keys_fd, zmq.POLLIN)
        links_fd = self._links.fileno()  # local listeners' plain links
        poller.register(links_fd, zmq.POLLIN)
        log.info("sink: serving pid=%s in=%s", os.getpid(), self.sin.getsockopt_string(zmq.LAST_ENDPOINT))
        try:
            self._loop(poller, streams_fd, wake_fd, keys_fd, links_fd)
            log.info("sink: stopping; final commit")
            self.state.commits.commit()
            replica = self.state.replica
            if replica is not None:
                left = replica.queue.drain(replica.cluster.settings.timeout_s)
                if left:
                    log.error("sink: stopping with %d run(s) the cluster never stored: given "
                              "up (their attempts were not acked: they run again)", left)
        except StoreStopped as exc:
            log.error("sink: %s", exc)

    def _loop(self, poller: zmq.Poller, streams_fd: int, wake_fd: int,
              keys_fd: int | None, links_fd: int) -> None:
        state, intake, subscribers = self.state, self.intake, self.subscribers
        commits, retention, replays, replica = (state.commits, state.retention, state.replays,
                                                state.replica)
        replaying = False  # a replay could take more at the end of the last turn
        cluster_fd = -1  # cluster mode: the cluster answered, followed calls' records came
        reading = True  # the workers' input is read (cluster mode: room for its runs)
        if replica is not None:
            cluster_fd = replica.wake_fd()
            poller.register(cluster_fd, zmq.POLLIN)
        while not self._stopping:
            if replica is not None and replica.queue.has_room() != reading:
                reading = not reading  # past the bound the workers' input waits
                poller.register(streams_fd, zmq.POLLIN if reading else 0)
                poller.register(self.sin, zmq.POLLIN if reading else 0)
            ready = dict(poller.poll(self._timeout(replaying)))
            if wake_fd in ready:  # plain fds come back as their fileno
                self._drain_signals()
            if self.ctl in ready or self._held:
                self._drain_ctl()
            if subscribers.socket in ready:
                subscribers.drain()
            if keys_fd in ready:
                subscribers.keys_changed()
            if links_fd in ready:
                subscribers.poll_links()
            if replica is not None:
                if cluster_fd in ready:
                    replica.on_wake()
                if replica.queue.due() <= time.monotonic():
                    replica.queue.retry()
            idle = True
            if streams_fd in ready:
                idle = intake.drain_streams()
            if self.sin in ready:
                idle = intake.drain_in(max(1, COMMIT_EVERY - commits.pending_events)) and idle
            if commits.pending_events:
                now = time.monotonic()
                if commits.commit_due is None:
                    commits.commit_due = now + COMMIT_AFTER_S
                if idle or commits.pending_events >= COMMIT_EVERY or now >= commits.commit_due:
                    commits.commit()
            if retention.due is not None and time.monotonic() >= retention.due:
                retention.prune()
            replaying = bool(replays.active) and replays.serve()
            if time.monotonic() >= subscribers.due:  # pings, revoked keys' listeners
                replays.drop(subscribers.tick())

    def _timeout(self, replaying: bool) -> int:
        """How long the next poll may wait (ms): until the next thing due."""
        commits, subscribers = self.state.commits, self.subscribers
        if replaying or self._held:
            timeout = 0
        elif subscribers.due < math.inf:
            timeout = max(0, int((subscribers.due - time.monotonic()) * 1000) + 1)
        else:
            timeout = IDLE_POLL_MS
        if commits.commit_due is not None:  # (pending, not idle: the input has more)
            timeout = min(timeout, max(0, int((commits.commit_due - time.monotonic()) * 1000) + 1))
        prune_due = self.state.retention.due
        if self.state.replica is not None:  # the cluster's tries again
            prune_due = min(prune_due or math.inf, self.state.replica.queue.due())
        if prune_due is not None and prune_due < math.inf:
            timeout = min(timeout, max(0, int((prune_due - time.monotonic()) * 1000) + 1))
        return timeout

    def _drain_signals(self) -> None:
        try:
            while self._wake_r.recv(512):
                pass
        except BlockingIOError:
            pass
        signals, self._signals = self._signals, []
        for signum in signals:
            if signum == signal.SIGTERM:
                self._stopping = True

    def close(self) -> None:
        signal.set_wakeup_fd(-1)
        self.sin.close()
        self.streams.close()
        self.ctl.close()
        self.subscribers.close()
        self.ctx.term()
        self.state.store.close()
        if self.state.replica is not None:
            self.state.replica.close()
        self._wake_r.close()
        self._wake_w.close()

    # ---- sockets ---------------------------------------------------------------------

    def _drain_ctl(self) -> None:
        """Up to CTL_BURST control ops: the held ones first, then the socket's."""
        for _ in range(CTL_BURST):
            got = self._held.popleft() if self._held else self._recv_ctl()
            if got is None:
                return
            ident, op = got
            self.state.handle_control(op, functools.partial(send, self.ctl, ident))

    def _recv_ctl(self) -> tuple[bytes, ControlOp] | None:
        """The next well-formed control op from the supervisor, counting (and,
        when its sender waits, refusing) anything else on the way; None when
        no message waits."""
        sock = self.ctl
        counters = self.state.counters
        while True:
            try:
                ident = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return None
            frame = sock.recv()
            if resync(sock):
                counters.bad_frame("ctl", "more than one frame")
                continue
            if not self.peer.admits(ident):
                counters.bad_frame("ctl", "control message from a peer that is not the supervisor")
                continue
            try:
                op = parse_control(decode_untrusted(frame))
            except ProtocolError as exc:
                counters.bad_frame("ctl", exc.message)
                continue
            except BadFrame as exc:
                counters.bad_frame("ctl", exc.reason)
                if exc.req is not None:  # the sender is waiting on this req: answer it
                    send(sock, ident, encode_refused(exc.req, f"bad_message: {exc.reason}"))
                continue
            self.peer.heard_from(ident)
            return ident, op

    def _pause(self, seconds: float) -> bool:
        """The store's wait between two tries of a write that met a storage
        fault (sink/store.py): up to `seconds`, woken by a signal or by the
        supervisor. A C_STATS is
        answered at once, so `status` shows the fault; any other control op
        is held, in order, for the loop (each needs a commit). True: a stop
        was asked (SIGTERM). While the store opens (no state yet, no SIGTERM
        handler: SIGTERM ends the process), it just sleeps."""
        if not self._ready:
            time.sleep(seconds)
            return False
        deadline = time.monotonic() + seconds
        poller = zmq.Poller()
        poller.register(self.ctl, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        wake_fd = self._wake_r.fileno()
        while not self._stopping and signal.SIGTERM not in self._signals:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ready = dict(poller.poll(int(left * 1000) + 1))
            if wake_fd in ready:
                self._drain_signals()
            if self.ctl in ready:
                while (got := self._recv_ctl()) is not None:
                    if isinstance(got[1], Stats):
                        send(self.ctl, got[0], encode_ok(got[1].req, self.state.stats()))
                    else:
                        self._held.append(got)
        return True


def _route_logs(runtime_dir: str, level: str | int) -> zmq.Socket[bytes]:
    """Ship our records to the supervisor's log socket (one log, one format)."""
    ctx: Any = zmq.Context.instance()
    sock: zmq.Socket[bytes] = ctx.socket(zmq.PUSH)
    sock.linger = 1000
    sock.sndhwm = 10_000
    sock.connect(Endpoints(runtime_dir).logs)
    route_logs_to(sock, level.upper() if isinstance(level, str) else level, "sink")
    return sock


def _setup_logging(level: str | int) -> None:
    # A spawned child starts with no handlers: give it stderr unless someone
    # configured logging already.
    base = logging.getLogger("streamfence")
    if not logging.getLogger().handlers and not base.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(
            "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"))
        base.addHandler(handler)
    logging.getLogger("streamfence.sink").setLevel(
        level.upper() if isinstance(level, str) else level)


def run_sink(runtime_dir: str, db_path: str, events_endpoint: str, keys_dir: str | None = None,
             log_level: str | int = "INFO", control_identity: bytes | None = None,
             log_to_supervisor: bool = False, retention_days: float = 0.0,
             cluster: ClusterSettings | None = None) -> None:
    """Process entry point: serve until SIGTERM (or the parent's death).

    `events_endpoint`: where subscribers connect (bound here); `keys_dir`:
    the key store that authenticates them (None: no authentication).
    `control_identity`: the ZeroMQ identity of the supervisor's control
    socket; control messages from any other peer are refused and counted.
    `retention_days`: finished calls older than this are pruned (0: never).
    `cluster`: cluster mode's settings (the calls' logs on JetStream: §4.17).
    Exits with ExitCode.CANNOT_BIND if the events endpoint cannot be bound."""
    set_process_title("sink")
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closing terminal's: the supervisor answers it
    log_sock = _route_logs(runtime_dir, log_level) if log_to_supervisor else None
    if log_sock is None:
        _setup_logging(log_level)
    if not die_with_parent(expected_parent_pid()):
        log.error("sink: parent already gone at start; exiting")
        sys.exit(ExitCode.PARENT_GONE)
    try:
        sink = Sink(runtime_dir, db_path, events_endpoint, keys_dir, control_identity,
                    retention_days, cluster)
    except zmq.ZMQError as exc:
        log.error("sink: cannot bind the events endpoint %s: %s", events_endpoint, exc)
        sys.exit(ExitCode.CANNOT_BIND)
    try:
        sink.serve()
    finally:
        sink.close()
        if log_sock is not None:
            logging.shutdown()
            log_sock.close()
