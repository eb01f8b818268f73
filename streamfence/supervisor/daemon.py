"""The supervisor: the daemon's main process.

Duties:
1. Answer clients (streamfence.supervisor.front, .clients); journal each call
   durably before acknowledging it.
2. Start and watch the sink (the only writer of the transcript) and the
   zygote (which forks the warm workers: streamfence.supervisor.zygotechild);
   every child dies with us (parent-death signal), and a dead sink or zygote
   is restarted with back-off (streamfence.supervisor.restarts); one that
   cannot start stops us.
3. Drive each call's attempts (streamfence.supervisor.attempts): authorize at the sink,
   dispatch to a warm worker, watch liveness, fence then kill, retry.
4. Tell the sink who subscribes to which call (the sink sends the events);
   re-emit every child's log records.

Each piece of state has one owner (see `Parts`); the loop here only moves
messages to their owner: each descriptor it polls has one handler, in one
table (`_watch`, streamfence.supervisor.watched). Signal handlers only set a
flag (streamfence.supervisor.stopsignals); the loop turns it into the same
stop a client could ask for, or a SIGHUP's reload (streamfence.supervisor.reload).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import secrets
import signal
import time
from typing import TYPE_CHECKING

import zmq

from streamfence.config.model import DaemonConfig
from streamfence.protocol.internal import Endpoints
from streamfence.protocol.internal.control import FROM_NOW
from streamfence.protocol.internal.workers import StopZygote
from streamfence.protocol.keys import KeyStore
from streamfence.protocol.messages import events_endpoint
from streamfence.protocol.states import WorkerState
from streamfence.supervisor import reload, replies
from streamfence.supervisor.auth import ClientAuth
from streamfence.supervisor.connections import FrontConnections
from streamfence.supervisor.gatewaychild import GatewayChild, GatewayEntry
from streamfence.supervisor.logs import drain_child_logs
from streamfence.supervisor.notify import Notifier
from streamfence.supervisor.parts import Parts, Sockets, build_parts
from streamfence.supervisor.restarts import GiveUp, RestartPolicy
from streamfence.supervisor.sinkchild import SinkChild
from streamfence.supervisor.startup import (
    StartupError,
    claim_state_dir,
    connect_cluster,
    open_stores,
    raise_fd_limit,
    spawn_context,
    start_tracer,
    warn_about_environment,
)
from streamfence.supervisor.stopsignals import StopSignals
from streamfence.supervisor.watched import Watched
from streamfence.supervisor.zygotechild import ZygoteChild
from streamfence.workers.liveness import LivenessTable

if TYPE_CHECKING:  # cluster mode only: it brings nats
    from streamfence.supervisor.shared_keys import SharedKeys

log = logging.getLogger("streamfence.supervisor")
# libzmq's I/O threads decrypt the clients' CURVE traffic, each connection on
# one of them. With one, a client sending 12 MB frames held every other
# client's messages behind their decryption. Heavy-clients chaos runs, p99 of
# a well-behaved client's status: 55-62 ms with one thread; 18-66 ms with
# four (bimodal: on the sender's thread or not); 18-24 ms with eight, four
# runs each (docs/PERFORMANCE.md). An idle I/O thread costs an epoll wait.
IO_THREADS = 8

FRONT_TURN_S = 0.005  # the most one turn spends reading client requests
IDLE_WAKE_S = 60.0  # the longest sleep: nothing is due (the loop is event driven)


class Daemon:
    """Owns the child processes (each through its SinkChild, ZygoteChild,
    GatewayChild) and their restarts, the sockets' lifetimes, and the loop."""

    def __init__(self, config: DaemonConfig, gateway: GatewayEntry | None = None) -> None:
        """`gateway`: the HTTP gateway's process entry (gateway/process.py
        `run_gateway`), handed in by the command line so that the supervisor
        never imports the gateway (an ordinary client of ours)."""
        self.config = config
        if config.http.listen is not None and gateway is None:
            raise StartupError("[http] listen is set but this daemon was built without a gateway")
        try:
            self.events_endpoint = events_endpoint(config.endpoint)
        except ValueError as exc:
            raise StartupError(f"daemon.endpoint: {exc}") from None
        state_dir, self._lock, self._runtime, self._pairing = claim_state_dir(
            config, self.events_endpoint)
        self._state_dir = state_dir
        self.keys = KeyStore(state_dir / "keys")
        self.runtime_dir = self._runtime.path
        self.endpoints = Endpoints(self.runtime_dir)
        self.transcript_path = os.path.abspath(os.path.join(config.state_dir, "transcript.db"))
        self._mp = spawn_context()
        self._signals = StopSignals()
        self._gave_up = False  # a child cannot start again: the daemon stops (exit 1)
        self._drain_until: float | None = None  # stopping: the running attempts' grace
        self._ready_logged = False
        self._zygote = ZygoteChild(self._mp, config, self.runtime_dir)
        self._gateway = GatewayChild(self._mp, config, self.runtime_dir, gateway)
        self._notify = Notifier()  # before any child starts: they must not inherit it
        self.ctx = zmq.Context(io_threads=IO_THREADS)
        self.auth = ClientAuth(self.ctx, self.keys, config.auth, config.identities,
                               config.endpoint)
        self.connections = FrontConnections(self.ctx, config.max_connections,
                                            self.auth.refuse_handshakes)
        # The sink obeys only this identity (passed to it at spawn, never sent).
        self._control_identity = b"sup-" + secrets.token_hex(16).encode()
        self._sink = SinkChild(self._mp, config, self.runtime_dir, self.transcript_path,
                               self.events_endpoint,
                               str(self.keys.dir) if config.auth == "curve" else None,
                               self._control_identity)
        self._watched = Watched()
        self._shared_keys: SharedKeys | None = None  # cluster mode

    # ---- child processes -----------------------------------------------------
    def _pids(self) -> dict[str, int | None]:
        """Each process's pid; None for a child that is down, awaiting its restart."""
        zygote = self._zygote
        pids = {"supervisor": os.getpid(),
                "sink": self._sink.pid(),
                "zygote": None if zygote.restarts.down else zygote.process.pid}
        if self._gateway.process is not None:
            pids["gateway"] = self._gateway.pid()
        return pids

    # ---- set-up --------------------------------------------------------------
    def _socket(self, kind: int, **options: int | bytes) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self.ctx.socket(kind)
        sock.linger = 0
        for name, value in options.items():
            sock.setsockopt(getattr(zmq, name), value)
        return sock

    def _sink_socket(self) -> zmq.Socket[bytes]:
        """The control connection to the sink (one per sink process: see `_sink_died`)."""
        sock = self._socket(zmq.DEALER, IDENTITY=self._control_identity, SNDHWM=0, RCVHWM=0)
        sock.connect(self.endpoints.sink_ctl)
        return sock

    def _bind_sockets(self) -> Sockets:
        """The workers', logs' and clients' sockets, bound; the sink's, connected."""
        cfg = self.config
        workers_sock = self._socket(zmq.ROUTER, ROUTER_MANDATORY=1)
        workers_sock.bind(self.endpoints.workers)
        logs_sock = self._socket(zmq.PULL)
        logs_sock.bind(self.endpoints.logs)
        # Refuse absurd frames at the transport (the peer is cut off), but let
        # moderately oversized ones through so they get a `too_large` reply.
        # Replies that cannot be queued raise (counted): supervisor/replies.py.
        front_sock = self._socket(zmq.ROUTER, MAXMSGSIZE=cfg.max_frame_bytes * 4,
                                  SNDHWM=replies.SEND_HWM, ROUTER_MANDATORY=1)
        self.auth.secure(front_sock)
        self.connections.watch(front_sock)
        try:
            front_sock.bind(cfg.endpoint)
        except zmq.ZMQError as exc:
            raise StartupError(f"cannot bind {cfg.endpoint}: {exc}") from None
        return workers_sock, logs_sock, front_sock, self._sink_socket()

    def _connection_counts(self) -> dict[str, int]:
        return {**self.auth.counts(), **self.connections.counts()}

    def _build(self) -> Parts:
        """Every owner, each built after what it needs; then the children start."""
        cfg = self.config
        tracer = start_tracer(cfg)  # before the stores: a start it refuses touches nothing
        journal, recovered = open_stores(cfg, self._state_dir, self._pairing,
                                         self.transcript_path)
        # The zygote first: its imports and warm-up are the longest path to a call
        # that can run and need nothing below (its pipe keeps what it sends).
        self._zygote.start()
        live = LivenessTable(self.endpoints.liveness_file, cfg.workers_max, create=True)
        sockets = self._bind_sockets()
        cluster = connect_cluster(cfg)
        if cluster is not None and cfg.auth == "curve":  # identities shared through the cluster
            from streamfence.supervisor.shared_keys import SharedKeys  # brings nats
            self._shared_keys = SharedKeys(self.keys, cluster.bridge, cfg.cluster.lease_s)
        parts = build_parts(cfg, journal, live, sockets, cluster, self._zygote.send,
                            self._sink.stats, self._pids, self._connection_counts,
                            self.connections.view,
                            self.transcript_path, tracer)
        self._sink.start(parts.sink)
        for call in recovered:
            parts.front.acceptance.recovered(call)
        parts.pool.maintain()
        return parts

    # ---- the loop -------------------------------------------------------------
    def run(self) -> int:
        raise_fd_limit(self.config.workers_max)
        warn_about_environment(self.config)
        self._signals.hold_hangups()  # until the loop runs; children spawned meanwhile inherit it
        try:
            p = self._build()
        except BaseException:
            self._stop_children()  # none left for multiprocess's exit handler to wait on
            self._runtime.remove()
            raise
        self._signals.install()
        self._watch(p)
        log.info("supervisor up: endpoint=%s state_dir=%s runtime_dir=%s",
                 self.config.endpoint, self.config.state_dir, self.runtime_dir)
        try:
            while self._turn(p):
                pass
        finally:
            self._signals.uninstall()
            self._shutdown(p)
        return 1 if self._gave_up else 0

    def _watch(self, p: Parts) -> None:
        """The descriptor -> handler table, in the order a turn serves them."""
        w = self._watched
        w.slot("wake", functools.partial(self._on_signal, p), self._signals)
        w.slot("front", functools.partial(self._drain_front, p), p.clients.socket)
        w.slot("request_files", p.front.acceptance.on_stored, p.journal.files.fileno())
        w.slot("journal_synced", p.journal.on_synced, p.journal.sync_fileno())
        w.slot("connections", self.connections.on_monitor, self.connections.monitor)
        if p.cluster is not None:
            w.slot("cluster", p.cluster.run_done, p.cluster.fd)
        w.slot("sink", functools.partial(p.sink.drain, p.driver), p.sink.socket)
        w.slot("workers", functools.partial(self._drain_workers, p), p.pool.socket)
        w.slot("logs", functools.partial(drain_child_logs, p.logs), p.logs)
        w.slot("sink_died", functools.partial(self._sink_died, p), self._sink.process.sentinel)
        w.slot("zygote", functools.partial(self._on_zygote, p), self._zygote.fileno())
        w.slot("gateway_died", self._gateway_died)
        gateway = self._gateway.start()  # now: the sockets it connects to are bound
        if gateway >= 0:
            w.watch("gateway_died", gateway)

    def _turn(self, p: Parts) -> bool:
        """One turn of the loop: what is ready, then what is due. False: stop."""
        if self._signals.requested and self._drain_until is None:
            self._drain_until = time.monotonic() + self.config.stop_grace_s
            p.front.admission.accepting = False
            self._notify.stopping("stopping: letting the running attempts finish")
            log.info("stop requested: no new calls; letting %d running attempt(s) "
                     "finish within %.0fs", p.driver.calls.busy(), self.config.stop_grace_s)
        until = self._drain_until
        draining = until is not None
        if until is not None and (p.driver.calls.busy() == 0 or time.monotonic() >= until):
            return False
        for handler in self._watched.poll(self._sleep_ms(p)):
            handler()
            if self._gave_up:
                return False
        if not self._ready_logged:
            self._check_ready(p)
        now = time.monotonic()
        self._restart_due(p, now)
        p.driver.on_timers(now)
        if p.cluster is not None and not draining:
            p.cluster.tick(now)
        if not draining:
            # Before the replies: new calls' first attempts join this
            # turn's journal transaction, so one commit (one fsync)
            # makes both the calls and their epochs durable.
            p.driver.schedule()
        p.front.acceptance.flush_accepts()
        p.clients.expire_waiters(now)
        p.sink.expire(now)
        p.journal.commit()
        p.front.acceptance.refuse_unstored()
        p.counters["journal_pruned"] += p.journal.prune_tick(self.config.retention_days)
        return True

    def _restart_due(self, p: Parts, now: float) -> None:
        """The children whose back-off is over start again, watched at once."""
        if self._gateway.restarts.take_due(now):
            self._watched.watch("gateway_died", self._gateway.start())
            p.counters["gateway_restarts"] += 1
        if self._sink.restarts.take_due(now):
            self._restart_sink(p)
            self._watched.watch("sink_died", self._sink.process.sentinel)
        if self._zygote.restarts.take_due(now):
            self._restart_zygote(p)
            self._watched.watch("zygote", self._zygote.fileno())

    def _sleep_ms(self, p: Parts) -> int:
        """How long the loop may sleep: until the nearest deadline of any owner
        (rounded up to the next ms, so it wakes at or after it)."""
        now = time.monotonic()
        due = [now + IDLE_WAKE_S, p.driver.next_due(), p.clients.next_due(),
               p.pool.next_due(), self._drain_until, self._sink.restarts.due(),
               self._zygote.restarts.due(), self._gateway.restarts.due(),
               p.journal.retry_due, p.sink.next_due(),
               p.cluster.next_due() if p.cluster is not None else None]
        if self.config.retention_days > 0:
            due.append(p.journal.prune_due)
        nearest = min(d for d in due if d is not None)
        return max(0, math.ceil((nearest - now) * 1000))

    # ---- the handlers ----------------------------------------------------------
    def _on_signal(self, p: Parts) -> None:
        """A signal came: a stop is the flag `_turn` reads; a SIGHUP, a reload."""
        self._signals.clear()
        if self._signals.take_hangups():
            self.config = reload.reload(self.config, p, self.auth)
            self._zygote.reconfigure(self.config)

    def _drain_front(self, p: Parts) -> None:
        # Bounded by time, not only by count: what this turn accepted is
        # committed and answered before the next requests are read (a burst
        # of large submits and subscribes once held one turn for 67 ms).
        until = time.perf_counter() + FRONT_TURN_S
        for _ in range(1000):
            if time.perf_counter() >= until:
                return  # the socket is still readable: the next poll returns at once
            try:
                frames = p.clients.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.connections.spoke(frames[-1])
            user = self.auth.user_of(frames[-1])
            if user is None:
                p.counters["refused.unauthenticated"] += 1
                continue  # a revoked key: no reply, as for a key never registered
            # The body as a view: a large one refused unread is never copied.
            p.front.handle([frames[0].bytes, *(f.buffer for f in frames[1:])], user)

    def _check_ready(self, p: Parts) -> None:
        """Once, when a call can run: a worker said hello and the sink (which
        authorizes each attempt) answered; the other spares may still be warming."""
        if (p.pool.count(WorkerState.IDLE, WorkerState.RESERVED, WorkerState.BUSY)
                and self._sink.restarts.serving):
            self._ready_logged = True
            log.info("ready: endpoint=%s, warm workers=%d", self.config.endpoint,
                     p.pool.count(WorkerState.IDLE))
            self._notify.ready(f"serving on {self.config.endpoint}")

    def _drain_workers(self, p: Parts) -> None:
        p.pool.drain()
        # Runs whose worker went idle without an accepted final (pool.drain found them).
        while p.pool.unaccepted:
            p.driver.on_final_unaccepted(*p.pool.unaccepted.pop())

    def _sink_died(self, p: Parts) -> None:
        """The sink died. What it answered counts; what it had not read goes
        with its connection, so every request failed as lost is lost (queued,
        it would reach the next sink beside the one sent again): a new
        connection. Then fail what it never answered and rebind the attempts
        in flight at once (ARCHITECTURE §2.8), and tell the next sink who
        follows the live calls; what is sent to it now waits in the socket
        until it starts, when its back-off ends. Gives up if it cannot
        start (the daemon stops)."""
        self._watched.unwatch("sink_died")  # none until the new sink starts
        p.sink.drain(p.driver)
        self._watched.unwatch("sink")
        p.sink.socket.close()
        p.sink.socket = self._sink_socket()
        self._watched.watch("sink", p.sink.socket)
        if not self._restart_later(self._sink.restarts, self._sink.reap()):
            return
        p.driver.on_sink_restart()
        # The new sink knows no subscriber: tell it again who follows the live
        # calls (from now on; a client repairs a gap from its last seq).
        for call_id, listener, owner in p.clients.following():
            p.sink.subscribe(call_id, listener, FROM_NOW, True, owner, lambda _: None)

    def _restart_sink(self, p: Parts) -> None:
        """Its back-off is over: a new sink on the same store (it rebuilds its
        epochs and each call's last content from it; what the dead one had not
        committed was never published)."""
        self._sink.start(p.sink)
        p.counters["sink_restarts"] += 1

    def _on_zygote(self, p: Parts) -> None:
        """What the zygote sent; if it died, its workers with it: their
        attempts end as killed. Gives up if it cannot start (the daemon stops)."""
        if self._zygote.drain(p.pool, p.driver):
            return
        self._watched.unwatch("zygote")
        if not self._restart_later(self._zygote.restarts, self._zygote.reap()):
            return
        for worker in p.pool.on_zygote_lost():
            p.driver.on_worker_exit(worker.call_id, worker.token, -signal.SIGKILL)

    def _restart_zygote(self, p: Parts) -> None:
        self._zygote.start()
        p.counters["zygote_restarts"] += 1
        self._zygote.send_backlog()
        p.pool.maintain()

    def _gateway_died(self) -> None:
        self._watched.unwatch("gateway_died")
        self._restart_later(self._gateway.restarts, self._gateway.reap())

    def _restart_later(self, policy: RestartPolicy, returncode: int | None) -> bool:
        """Whether the dead child is started again (its policy logged when);
        if not, the daemon gives up."""
        decision = policy.died(returncode, stopping=self._signals.requested)
        if isinstance(decision, GiveUp):
            log.critical("%s; stopping (the journal keeps every accepted call for the next "
                         "start)", decision.reason)
            self._gave_up = True
            return False
        return True

    # ---- stopping ----------------------------------------------------------------
    def _shutdown(self, p: Parts) -> None:
        log.info("stopping")
        self._notify.stopping("stopping")
        self._stop_children()
        p.front.calls.close()
        p.journal.close()  # before abandon_staged: the accepts a last commit lets go
        p.front.acceptance.abandon_staged()
        self.connections.close(p.clients.socket)
        for sock in (p.clients.socket, p.sink.socket, p.pool.socket, p.logs):
            sock.close(linger=0)
        self.auth.stop()
        self.ctx.term()
        p.pool.close()
        if p.cluster is not None:
            p.cluster.close()
        if p.tracer is not None:
            p.tracer.close()  # the spans of the calls that ended last
        self._runtime.remove()
        self._lock.release()
        log.info("stopped")

    def _stop_children(self) -> None:
        """Stop the zygote and the sink (SIGTERM, SIGKILL after 5 s) and reap them."""
        with contextlib.suppress(Exception):
            self._zygote.send(StopZygote())
        children = (self._gateway.process, self._zygote.process, self._sink.process)
        for proc in children:
            if proc is not None and proc.is_alive():
                proc.terminate()
        for proc in children:
            if proc is not None:
                proc.join(timeout=5.0)
                if proc.is_alive():
                    proc.kill()
                    proc.join(timeout=1.0)

