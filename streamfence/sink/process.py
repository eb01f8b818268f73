"""The sink process: the only writer of the transcript.

Duties (`run_sink` is the entry point the supervisor starts with
`multiprocess.get_context("spawn").Process(target=run_sink, ...)`):

- listen on the worker wire `sink.stream` (workers' T_DELTA, T_FINAL over
  AF_UNIX stream connections, sink/streams.py), bind ROUTER `sink.in` (the
  same messages as ZeroMQ frames, for tests and tools), ROUTER `sink.ctl`
  (the supervisor: C_AUTHORIZE, C_FENCE, C_FINISH, C_STATS, C_SUBSCRIBE), see
  streamfence.protocol.internal, and the public events socket (the calls'
  subscribers, sink/subscribers.py);
- per delta: the fence check (`FenceTable.check`); on ACCEPT assign the call's
  next public seq, build the public delta event, queue it for the store,
  accumulate content, and, if the call has listeners, queue the event for
  them;
- group commit: when 1000 events are pending, when the input runs dry (at
  most once per 0.2 ms: tiny commits churn the WAL), or 5 ms after the first
  pending event; queued events are sent right after the commit that stored
  them (durable before visible), and authorize / final acks / done events
  are sent after a commit too;
- count and sparsely log refused deltas and bad frames; never crash on input;
- retention: one batch of finished calls deleted from the transcript when
  `state.prune_due` has come (sink/state.py, "Retention");
- storage faults (a full disk, an I/O error, a lock held past the busy
  timeout: docs/ARCHITECTURE.md §4.15) are waited out inside the store's
  commit, through `_pause`: it answers C_STATS meanwhile (status shows the
  fault), holds every other control op for the loop, in order, and tells
  the store when a stop was asked;
- die with the parent (PR_SET_PDEATHSIG) and exit cleanly on SIGTERM after a
  last commit (given up, in one ERROR line, if the store is in a storage
  fault). SIGINT is ignored: the supervisor owns the shutdown order.

The per-delta path is one method, `_take`, on purpose flat: an integer tag
test, a dict lookup in the fence, list appends and pre-encoded byte pieces;
both doors decode before it (a stream's unpacker, or one frame).
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

import msgpack
import zmq

from streamfence.cluster.settings import ClusterSettings
from streamfence.protocol.codec import DEFAULT_MAX_FRAME, decode_untrusted
from streamfence.protocol.errors import ProtocolError
from streamfence.protocol.internal import T_DELTA, T_HELLO, Endpoints
from streamfence.protocol.internal.control import (
    BadFrame,
    ControlOp,
    Stats,
    encode_ok,
    encode_refused,
    parse_control,
)
from streamfence.protocol.internal.worker_wire import (
    TOOL_CALL,
    check_tool_fragment,
    parse_final,
    parse_hello,
)
from streamfence.protocol.keys import KeyStore
from streamfence.protocol.lifecycle import (
    ExitCode,
    die_with_parent,
    expected_parent_pid,
    set_process_title,
)
from streamfence.protocol.logs import route_logs_to
from streamfence.sink.event_pieces import KIND_TAIL
from streamfence.sink.fence import Verdict
from streamfence.sink.peer import SupervisorPeer
from streamfence.sink.state import COMMIT_AFTER_S, COMMIT_EVERY, IDLE_COMMIT_GAP_S, SinkState, log
from streamfence.sink.store import StoreStopped, TranscriptStore
from streamfence.sink.streams import READ_BYTES, WorkerStreams
from streamfence.sink.subscribers import Subscribers

CTL_BURST = 100
IDLE_POLL_MS = 60_000  # nothing due: the loop is event driven (signals wake it)

_ACCEPT = Verdict.ACCEPT
_PARSE_ERRORS = (ValueError, TypeError, KeyError, IndexError, msgpack.UnpackException)
_STREAM_ERRORS = (ValueError, msgpack.UnpackException, msgpack.BufferFull, RecursionError)


class Sink:
    """Owns the worker and control sockets, the loop, signal handling and the
    per-delta hot path; `state` (SinkState) owns the fence, the calls, the
    store and the counters, `peer` (SupervisorPeer) what goes to the
    supervisor, `subscribers` the events socket."""

    def __init__(self, runtime_dir: str, db_path: str, events_endpoint: str,
                 keys_dir: str | None = None, control_identity: bytes | None = None,
                 retention_days: float = 0.0, cluster: ClusterSettings | None = None) -> None:
        ep = Endpoints(runtime_dir)
        self.ctx = zmq.Context()
        self.sin = self._router(ep.sink_in)
        self.streams = WorkerStreams(ep.sink_stream)
        self.ctl = self._router(ep.sink_ctl)
        self.peer = SupervisorPeer(self.ctl, control_identity)
        self.subscribers = Subscribers(self.ctx, events_endpoint,
                                       KeyStore(keys_dir) if keys_dir is not None else None)
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
        self._ready = True

    def _router(self, endpoint: str) -> zmq.Socket[bytes]:
        s: zmq.Socket[bytes] = self.ctx.socket(zmq.ROUTER)
        # Mandatory: an unknown peer is an error we see, not a silent drop.
        # No send HWM: the supervisor is our own process and must get every
        # event (with HWM+mandatory a send could block the loop instead).
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 10_000)
        s.setsockopt(zmq.MAXMSGSIZE, DEFAULT_MAX_FRAME)
        s.setsockopt(zmq.LINGER, 500)
        s.bind(endpoint)
        return s

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
        log.info("sink: serving pid=%s in=%s", os.getpid(), self.sin.getsockopt_string(zmq.LAST_ENDPOINT))
        try:
            self._loop(poller, streams_fd, wake_fd)
            log.info("sink: stopping; final commit")
            self.state.commit()
        except StoreStopped as exc:
            log.error("sink: %s", exc)

    def _loop(self, poller: zmq.Poller, streams_fd: int, wake_fd: int) -> None:
        state = self.state
        idle = True  # the input ran dry in the last drain
        subscribers = self.subscribers
        replaying = False  # a replay could take more at the end of the last turn
        cluster_fd = -1  # cluster mode: the followed calls' records came
        if state.cluster is not None:
            cluster_fd = state.cluster.bridge.fd
            poller.register(cluster_fd, zmq.POLLIN)
        while not self._stopping:
            if replaying or self._held:
                timeout = 0
            elif subscribers.outstanding:
                timeout = max(0, int((subscribers.ping_due - time.monotonic()) * 1000) + 1)
            else:
                timeout = IDLE_POLL_MS
            if state.commit_due is not None:
                due = min(state.commit_due, state.last_commit + IDLE_COMMIT_GAP_S) \
                    if idle else state.commit_due
                timeout = min(timeout, max(0, int((due - time.monotonic()) * 1000) + 1))
            if state.prune_due is not None:
                timeout = min(timeout, max(0, int((state.prune_due - time.monotonic()) * 1000) + 1))
            ready = dict(poller.poll(timeout))
            if wake_fd in ready:  # plain fds come back as their fileno
                self._drain_signals()
            if self.ctl in ready or self._held:
                self._drain_ctl()
            if subscribers.socket in ready:
                subscribers.drain()
            if cluster_fd in ready and state.cluster is not None:
                state.cluster.bridge.run_done()
                state.apply_followed(state.cluster.incoming())
            idle = True
            if streams_fd in ready:
                idle = self._drain_streams()
            if self.sin in ready:
                idle = self._drain_in(max(1, COMMIT_EVERY - state.pending_events)) and idle
            if state.pending_events:
                now = time.monotonic()
                if state.commit_due is None:
                    state.commit_due = now + COMMIT_AFTER_S
                if (state.pending_events >= COMMIT_EVERY or now >= state.commit_due
                        or (idle and now >= state.last_commit + IDLE_COMMIT_GAP_S)):
                    state.commit()
            if state.prune_due is not None and time.monotonic() >= state.prune_due:
                state.prune()
            replaying = bool(state.replays) and state.serve_replays()
            if subscribers.outstanding and time.monotonic() >= subscribers.ping_due:
                subscribers.ping()

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
        if self.state.cluster is not None:
            self.state.cluster.close()
        self._wake_r.close()
        self._wake_w.close()

    # ---- sockets ---------------------------------------------------------------------

    def _resync(self, sock: zmq.Socket[bytes]) -> bool:
        """Drop the rest of a multi-part message; True if there was any."""
        if not sock.getsockopt(zmq.RCVMORE):
            return False
        while sock.getsockopt(zmq.RCVMORE):
            sock.recv()
        return True

    def _drain_ctl(self) -> None:
        """Up to CTL_BURST control ops: the held ones first, then the socket's."""
        for _ in range(CTL_BURST):
            got = self._held.popleft() if self._held else self._recv_ctl()
            if got is None:
                return
            ident, op = got
            self._send(self.ctl, ident, self.state.handle_control(op))

    def _recv_ctl(self) -> tuple[bytes, ControlOp] | None:
        """The next well-formed control op from the supervisor, counting (and,
        when its sender waits, refusing) anything else on the way; None when
        no message waits."""
        sock = self.ctl
        state = self.state
        while True:
            try:
                ident = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return None
            frame = sock.recv()
            if self._resync(sock):
                state.bad_frame("ctl", "more than one frame")
                continue
            if not self.peer.admits(ident):
                state.bad_frame("ctl", "control message from a peer that is not the supervisor")
                continue
            try:
                op = parse_control(decode_untrusted(frame))
            except ProtocolError as exc:
                state.bad_frame("ctl", exc.message)
                continue
            except BadFrame as exc:
                state.bad_frame("ctl", exc.reason)
                if exc.req is not None:  # the sender is waiting on this req: answer it
                    self._send(sock, ident, encode_refused(exc.req, f"bad_message: {exc.reason}"))
                continue
            self.peer.heard_from(ident)
            return ident, op

    def _pause(self, seconds: float) -> bool:
        """The store's wait between two tries of a write that met a storage
        fault (sink/store.py): up to `seconds`, woken by a signal or by the
        supervisor. A C_STATS is answered at once, so `status` shows the
        fault; any other control op is held, in order, for the loop (each
        needs a commit). True: a stop was asked (SIGTERM). While the store
        opens (no state yet, no SIGTERM handler: SIGTERM ends the process),
        it just sleeps."""
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
                        self._send(self.ctl, got[0], encode_ok(got[1].req, self.state.stats()))
                    else:
                        self._held.append(got)
        return True

    def _send(self, sock: zmq.Socket[bytes], ident: bytes, frame: bytes) -> bool:
        try:
            sock.send(ident, zmq.SNDMORE | zmq.NOBLOCK)
            sock.send(frame, zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False  # the peer is gone (EHOSTUNREACH): nobody to answer

    def _out_of_line(self, msg: Any, reply: Callable[[bytes], bool]) -> None:
        """Anything from a worker that is not a well-formed delta: a final, a
        hello, or garbage."""
        state = self.state
        try:
            if msg[0] == T_HELLO:
                state.handle_hello(parse_hello(msg), reply)
                return
            final = parse_final(msg)
        except BadFrame as exc:
            state.bad_frame("in", exc.reason)
            return
        if not reply(state.handle_final(final)):
            # The worker exited without waiting for its ack (it will count the
            # attempt as unfinished); the supervisor has E_ENDED anyway.
            state.acks_unroutable += 1

    def _take(self, msgs: Iterable[Any], reply: Callable[[bytes], bool]) -> None:
        """Decoded worker messages from one sender (the per-delta hot path, a
        loop with locals on purpose): the fence check, then, accepted, the
        call's next public seq, the public event built from pre-encoded pieces,
        queued for the store and (after its commit) for the call's listeners.
        Anything else goes out of line; `reply` sends a final's ack back."""
        state = self.state
        check = state.fence.check
        lives = state.lives
        pack = state.pack
        tails = KIND_TAIL
        dirty_append = state.dirty.append
        outbox_append = state.outbox.append
        n = 0
        try:
            for msg in msgs:
                try:
                    tag = msg[0]
                    if tag != T_DELTA or type(tag) is not int:
                        # Out of line (finals, garbage). It may commit: settle
                        # the counters first.
                        state.pending_events += n
                        state.accepted += n
                        n = 0
                        self._out_of_line(msg, reply)
                        continue
                    # worker_wire.parse_delta's checks, inline: a call per
                    # delta would cost about a quarter of the parse.
                    _, call, attempt, seq, kind, data = msg
                    tail = tails[kind]
                    if type(call) is not str or type(attempt) is not int \
                            or type(seq) is not int:
                        raise TypeError
                    if kind == TOOL_CALL:
                        check_tool_fragment(data)
                    elif type(data) is not str:
                        raise TypeError
                except _PARSE_ERRORS:
                    state.bad_frame("in", "malformed T_DELTA")
                    continue
                verdict = check(call, attempt, seq)
                if verdict is not _ACCEPT:
                    state.drop(call, attempt, seq, verdict)
                    continue
                live = lives[call]
                pseq = live.seq + 1
                live.seq = pseq
                event = live.prefix + pack(pseq) + tail + pack(data)
                pending = live.pending
                if not pending:
                    live.pending_seq = pseq
                    dirty_append(live)
                pending.append(event)
                live.add[kind](data)
                n += 1
                subs = live.subs
                if subs:
                    outbox_append((subs, event))  # sent after its commit
        finally:
            state.pending_events += n
            state.accepted += n

    def _drain_streams(self) -> bool:
        """The workers' stream connections: every message that arrived. True if
        the input ran dry (no connection filled its read)."""
        idle = True
        for conn, data in self.streams.ready():
            idle = idle and len(data) < READ_BYTES
            try:
                conn.unpacker.feed(data)  # BufferFull: a message over the frame limit
                self._take(conn.unpacker, conn.send)
            except _STREAM_ERRORS:
                self.state.bad_frame("in", "a worker's stream cannot be framed (not msgpack, or "
                                           "a message over the frame limit); connection closed")
                self.streams.drop(conn)
        return idle

    def _drain_in(self, budget: int) -> bool:
        """The ZeroMQ door of the worker wire (`sink.in`, kept beside the
        stream socket that workers use): up to `budget` single-frame messages.
        True if the input ran dry."""
        sock = self.sin
        state = self.state
        for _ in range(budget):
            try:
                ident = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            try:
                frame = sock.recv(zmq.NOBLOCK)  # never block: a message arrives whole
            except zmq.Again:
                state.bad_frame("in", "lone frame (a misaligned multi-part message)")
                return True
            if self._resync(sock):
                state.bad_frame("in", "more than one frame")
                continue
            try:
                msg = decode_untrusted(frame)
            except ProtocolError as exc:
                state.bad_frame("in", exc.message)
                continue
            self._take((msg,), functools.partial(self._send, sock, ident))
        return False


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
