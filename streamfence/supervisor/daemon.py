"""The supervisor: the daemon's main process.

Duties:
1. Answer clients (streamfence.supervisor.front, .clients); journal each call
   durably before acknowledging it.
2. Start and watch the sink (the only writer of the transcript) and the
   zygote (which forks the warm workers); every child dies with us
   (parent-death signal), and a dead sink or zygote is restarted with
   back-off (streamfence.supervisor.restarts); one that cannot start stops us.
3. Drive each call's attempts (streamfence.supervisor.attempts): authorize at the sink,
   dispatch to a warm worker, watch liveness, fence then kill, retry.
4. Fan accepted events out to subscribers; re-emit every child's log records.

Each piece of state has one owner (see `Parts`); the loop here only moves
messages to their owner. Signal handlers only set a flag; the loop turns it
into the same stop a client could ask for.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import random
import resource
import secrets
import signal
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack
import multiprocess
import zmq

from streamfence.cluster.settings import ClusterSettings
from streamfence.config.model import DaemonConfig
from streamfence.protocol.internal import L_RECORD, Endpoints
from streamfence.protocol.internal.control import FROM_NOW
from streamfence.protocol.internal.workers import (
    StopZygote,
    WorkerExited,
    WorkerSpawned,
    ZygoteCommand,
    ZygoteLog,
    ZygoteReady,
    decode_zygote_event,
    encode_zygote,
)
from streamfence.protocol.keys import KeyStore
from streamfence.protocol.lifecycle import ExitCode
from streamfence.protocol.messages import events_endpoint
from streamfence.protocol.states import WorkerState
from streamfence.sink.process import run_sink
from streamfence.supervisor import statedir, storepair
from streamfence.supervisor.attempts import AttemptDriver
from streamfence.supervisor.auth import ClientAuth
from streamfence.supervisor.breaker import Breakers
from streamfence.supervisor.calls import Call
from streamfence.supervisor.clients import Clients
from streamfence.supervisor.front import Front
from streamfence.supervisor.journal import Journal
from streamfence.supervisor.logs import emit_child_record
from streamfence.supervisor.notify import Notifier
from streamfence.supervisor.pool import Pool, exit_text
from streamfence.supervisor.recovery import recover_calls
from streamfence.supervisor.restarts import GiveUp, RestartPolicy
from streamfence.supervisor.sinklink import SinkLink
from streamfence.supervisor.status import status_of
from streamfence.workers.liveness import LivenessTable

if TYPE_CHECKING:  # cluster mode only: it brings nats
    from streamfence.supervisor.clusterlink import ClusterLink

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


GatewayEntry = Callable[[DaemonConfig, str], None]  # (config, runtime dir)


class StartupError(Exception):
    pass


@dataclass(frozen=True, slots=True)
class Parts:
    """The supervisor's owners, built in dependency order by `Daemon._build`:
    journal (journal.db), pool (workers, the `workers` socket, liveness),
    clients (the client socket's sends, subscribers, event buffers, waiters),
    sink (SinkLink: requests in flight on `sink.ctl`), breakers, driver (calls,
    queue, fall-backs), front (request handling). `counters` are tallies each
    incremented by one owner (the daemon's: sink and zygote restarts), read by
    `status`."""

    journal: Journal
    pool: Pool
    clients: Clients
    sink: SinkLink
    breakers: Breakers
    driver: AttemptDriver
    front: Front
    counters: Counter[str]
    logs: zmq.Socket[bytes]
    cluster: ClusterLink | None = None  # cluster mode (ARCHITECTURE §4.17)


class Daemon:
    """Owns the child processes (sink, zygote) and their restarts, the sockets'
    lifetimes, and the loop."""

    def __init__(self, config: DaemonConfig, gateway: GatewayEntry | None = None) -> None:
        """`gateway`: the HTTP gateway's process entry (gateway/process.py
        `run_gateway`), handed in by the command line so that the supervisor
        never imports the gateway (an ordinary client of ours)."""
        self.config = config
        if config.http.listen is not None and gateway is None:
            raise StartupError("[http] listen is set but this daemon was built without a gateway")
        self._gateway_entry = gateway
        try:
            state_dir = statedir.prepare(config.state_dir)
            self._lock = statedir.StateLock(state_dir)
        except statedir.StateDirError as exc:
            raise StartupError(str(exc)) from None
        try:
            self._pairing = storepair.check(state_dir, cluster=self.config.cluster.enabled)
        except storepair.StoreError as exc:
            self._lock.release()
            raise StartupError(str(exc)) from None
        self._state_dir = state_dir
        self.keys = KeyStore(state_dir / "keys")
        try:
            self.events_endpoint = events_endpoint(config.endpoint)
        except ValueError as exc:
            raise StartupError(f"daemon.endpoint: {exc}") from None
        self.runtime_dir = config.runtime_dir()
        self.endpoints = Endpoints(self.runtime_dir)
        self.transcript_path = os.path.abspath(os.path.join(config.state_dir, "transcript.db"))
        self._mp = multiprocess.get_context("spawn")
        self._stop = False
        self._ready_logged = False
        self._zygote: Any = None
        self._zygote_conn: Any = None
        self._zygote_ready = False
        self._sink: Any = None
        self._sink_restarts = RestartPolicy("sink", time.monotonic, {ExitCode.CANNOT_BIND: (
            f"the events endpoint {self.events_endpoint} cannot be bound (the client "
            f"endpoint's port + 1, or its path + '.events': docs/PROTOCOL.md §1)")})
        self._zygote_restarts = RestartPolicy("zygote", time.monotonic)
        self._gateway: Any = None  # the HTTP gateway, when [http] listen is set
        self._gateway_restarts = RestartPolicy("gateway", time.monotonic, {
            ExitCode.CANNOT_BIND: f"the gateway cannot listen on {config.http.listen}"})
        self._zygote_backlog: list[ZygoteCommand] = []  # asked while the zygote is down
        self._notify = Notifier()  # before any child starts: they must not inherit it
        self.ctx = zmq.Context(io_threads=IO_THREADS)
        self.auth = ClientAuth(self.ctx, self.keys, config.auth, config.identities,
                               config.endpoint, config.max_connections)
        # The sink obeys only this identity (passed to it at spawn, never sent).
        self._control_identity = b"sup-" + secrets.token_hex(16).encode()

    # ---- child processes -----------------------------------------------------
    def _start_sink(self) -> None:
        self._sink = self._mp.Process(
            target=run_sink, name="sink",
            args=(self.runtime_dir, self.transcript_path, self.events_endpoint,
                  str(self.keys.dir) if self.config.auth == "curve" else None,
                  self.config.log_level, self._control_identity, True,
                  self.config.retention_days, self._cluster_settings()))
        self._sink.start()
        self._sink_restarts.started()

    def _start_zygote(self) -> None:
        from streamfence.workers.zygote_entry import zygote_main  # no SDK import here

        parent_conn, child_conn = self._mp.Pipe(duplex=True)
        self._zygote = self._mp.Process(
            target=zygote_main, name="zygote",
            args=(child_conn, self.runtime_dir, self.config.workers_max,
                  logging.getLevelName(self.config.log_level), os.getpid()))
        self._zygote.start()
        self._zygote_restarts.started()
        child_conn.close()
        self._zygote_conn = parent_conn
        self._zygote_ready = False

    def _start_gateway(self) -> int:
        """Start the HTTP gateway (an ordinary client of ours); its sentinel, or -1."""
        if self._gateway_entry is None:
            return -1
        self._gateway = self._mp.Process(target=self._gateway_entry, name="gateway",
                                         args=(self.config, self.runtime_dir))
        self._gateway.start()
        self._gateway_restarts.started()
        return int(self._gateway.sentinel)

    def _to_zygote(self, cmd: ZygoteCommand) -> None:
        if self._zygote_restarts.down:
            self._zygote_backlog.append(cmd)  # for the next zygote, once it starts
            return
        # A zygote that just died (its pipe's end not yet seen) forgets what it
        # was asked: the loop sees the end next and forgets the workers too.
        with contextlib.suppress(OSError):
            self._zygote_conn.send_bytes(encode_zygote(cmd))

    def _pids(self) -> dict[str, int | None]:
        """Each process's pid; None for a child that is down, awaiting its restart."""
        pids = {"supervisor": os.getpid(),
                "sink": None if self._sink_restarts.down else self._sink.pid,
                "zygote": None if self._zygote_restarts.down else self._zygote.pid}
        if self._gateway is not None:
            pids["gateway"] = None if self._gateway_restarts.down else self._gateway.pid
        return pids

    def _probe_sink(self, link: SinkLink) -> None:
        """Ask the new sink for its counters: its answer shows that it serves."""
        started = self._sink

        def answered(_stats: dict[str, Any]) -> None:
            # The link answers from its last counters when the sink died first.
            if self._sink is started and not self._sink_restarts.down:
                self._sink_restarts.ready()

        link.read_stats(answered)

    def _sink_stats(self, link: SinkLink, reply: Callable[[dict[str, Any]], None]) -> None:
        """The sink's counters for `status`: asked for, or the last ones known, at
        once, while the sink is down or not yet serving (status must not wait
        for its back-off or its start)."""
        if self._sink_restarts.serving:
            link.read_stats(reply)
        else:
            reply(dict(link.stats))

    # ---- set-up --------------------------------------------------------------
    def _socket(self, kind: int, **options: int | bytes) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self.ctx.socket(kind)
        sock.linger = 0
        for name, value in options.items():
            sock.setsockopt(getattr(zmq, name), value)
        return sock

    def _sink_socket(self) -> zmq.Socket[bytes]:
        """The control connection to the sink (one per sink process: see `run`)."""
        sock = self._socket(zmq.DEALER, IDENTITY=self._control_identity, SNDHWM=0, RCVHWM=0)
        sock.connect(self.endpoints.sink_ctl)
        return sock

    def _build(self) -> Parts:
        """Every owner, each built after what it needs; then the children start."""
        cfg = self.config
        journal, recovered = self._open_stores()
        for name in ("sink.in", "sink.stream", "sink.ctl", "workers", "logs"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.runtime_dir, name))
        live = LivenessTable(self.endpoints.liveness_file, cfg.workers_max, create=True)
        workers_sock = self._socket(zmq.ROUTER, ROUTER_MANDATORY=1)
        workers_sock.bind(self.endpoints.workers)
        logs_sock = self._socket(zmq.PULL)
        logs_sock.bind(self.endpoints.logs)
        # Refuse absurd frames at the transport (the peer is cut off), but let
        # moderately oversized ones through so they get a `too_large` reply.
        front_sock = self._socket(zmq.ROUTER, MAXMSGSIZE=cfg.max_frame_bytes * 4,
                                  SNDHWM=100_000)
        self.auth.secure(front_sock)
        try:
            front_sock.bind(cfg.endpoint)
        except zmq.ZMQError as exc:
            raise StartupError(f"cannot bind {cfg.endpoint}: {exc}") from None
        sink_sock = self._sink_socket()

        clock = time.monotonic
        counters: Counter[str] = Counter()
        cluster = self._connect_cluster()
        pool = Pool(self._to_zygote, workers_sock, live, slots=cfg.workers_max,
                    spare=cfg.workers_spare, max_workers=cfg.workers_max)
        clients = Clients(front_sock)
        sink = SinkLink(sink_sock)
        breakers = Breakers(cfg.breaker_threshold, cfg.breaker_cooldown_s, clock)
        driver = AttemptDriver(cfg, journal, pool, sink, clients, breakers, counters, clock,
                               random.Random(), self.transcript_path, cluster)
        status = functools.partial(status_of, pool, driver, breakers,
                                   functools.partial(self._sink_stats, sink), counters,
                                   self._pids, self.auth.counts, journal.fault_view)
        front = Front(cfg, journal, driver, clients, sink, breakers, counters, clock,
                      self.transcript_path, status, cluster)
        parts = Parts(journal, pool, clients, sink, breakers, driver, front, counters, logs_sock,
                      cluster)
        if cluster is not None:
            cluster.on_taken = driver.adopt
            cluster.knows = driver.has_call
            cluster.on_cancel = front.cancel_for_peer

        self._start_sink()
        self._probe_sink(sink)
        self._start_zygote()
        for call in recovered:
            driver.enqueue(call)
        pool.maintain()
        return parts

    def _connect_cluster(self) -> ClusterLink | None:
        """Cluster mode: the supervisor's link to the NATS cluster (its streams and
        buckets made if missing); a cluster that cannot be reached stops the start."""
        cfg = self.config.cluster
        settings = self._cluster_settings()
        if settings is None:
            return None
        from streamfence.supervisor.clusterlink import ClusterLink  # brings nats

        try:
            link = ClusterLink(settings, cfg.lease_s, time.monotonic)
        except Exception as exc:
            raise StartupError(f"cannot reach the NATS cluster at {', '.join(cfg.urls)}: "
                               f"{type(exc).__name__}: {exc}") from None
        log.info("cluster: host %r, %d replica(s), NATS at %s", cfg.host, cfg.replicas,
                 ", ".join(cfg.urls))
        return link

    def _cluster_settings(self) -> ClusterSettings | None:
        cfg = self.config.cluster
        if not cfg.enabled:
            return None
        return ClusterSettings(cfg.urls, cfg.host, cfg.replicas, cfg.timeout_s)

    def _open_stores(self) -> tuple[Journal, list[Call]]:
        """The journal, this start's stamp in both files (ARCHITECTURE §4.13),
        and the calls to run again: before any child starts, so that damage
        found here stops the daemon with no child to wait for."""
        path = os.path.join(self.config.state_dir, storepair.JOURNAL)
        try:
            with storepair.reading(path):
                journal = Journal(path)
            storepair.stamp(self._state_dir, self._pairing)
            with storepair.reading(path):
                recovered = recover_calls(journal, self.config.providers, self.transcript_path)
        except storepair.StoreError as exc:
            raise StartupError(str(exc)) from None
        pairing = self._pairing
        if pairing.previous == 0:
            log.info("stores: journal.db and transcript.db are store %s from now on "
                     "(generation 1)", pairing.store_id)
        else:
            log.info("stores: store %s, generation %d", pairing.store_id, pairing.generation)
        return journal, recovered

    # ---- the loop -------------------------------------------------------------
    def request_stop(self, signum: int = 0, frame: Any = None) -> None:
        self._stop = True

    def run(self) -> int:
        _raise_fd_limit(self.config.workers_max)
        for profile in self.config.providers.values():
            if profile.api_key_env and not os.environ.get(profile.api_key_env):
                log.warning("provider profile %r: its api_key_env %s is not set; its calls "
                            "will fail with credentials_missing", profile.name,
                            profile.api_key_env)
        try:
            p = self._build()
        except BaseException:
            self._stop_children()  # none left for multiprocess's exit handler to wait on
            raise
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        # A signal must end the poll at once: the loop may sleep for seconds.
        wake_r, wake_w = socket.socketpair()
        for end in (wake_r, wake_w):
            end.setblocking(False)
        signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
        front_sock, sink_sock, workers_sock = p.clients.socket, p.sink.socket, p.pool.socket
        poller = zmq.Poller()
        for sock in (front_sock, sink_sock, workers_sock, p.logs):
            poller.register(sock, zmq.POLLIN)
        zygote_fd = self._zygote_conn.fileno()
        poller.register(zygote_fd, zmq.POLLIN)
        sink_fd = self._sink.sentinel
        poller.register(sink_fd, zmq.POLLIN)
        gateway_fd = self._start_gateway()  # now: the sockets it connects to are bound
        if gateway_fd >= 0:
            poller.register(gateway_fd, zmq.POLLIN)
        poller.register(wake_r, zmq.POLLIN)
        request_files = p.journal.files.fileno()
        poller.register(request_files, zmq.POLLIN)
        journal_synced = p.journal.sync_fileno()
        poller.register(journal_synced, zmq.POLLIN)
        connections = self.auth.monitor
        poller.register(connections, zmq.POLLIN)
        cluster_fd = p.cluster.fd if p.cluster is not None else -1
        if p.cluster is not None:
            poller.register(cluster_fd, zmq.POLLIN)
        log.info("supervisor up: endpoint=%s state_dir=%s runtime_dir=%s",
                 self.config.endpoint, self.config.state_dir, self.runtime_dir)
        code = 0
        try:
            drain_until: float | None = None
            while True:
                if self._stop and drain_until is None:
                    drain_until = time.monotonic() + self.config.stop_grace_s
                    p.front.accepting = False
                    self._notify.stopping("stopping: letting the running attempts finish")
                    log.info("stop requested: no new calls; letting %d running attempt(s) "
                             "finish within %.0fs", p.driver.busy(), self.config.stop_grace_s)
                if drain_until is not None and (p.driver.busy() == 0
                                                or time.monotonic() >= drain_until):
                    break
                ready = dict(poller.poll(self._sleep_ms(p, drain_until)))
                if wake_r.fileno() in ready:
                    with contextlib.suppress(BlockingIOError):
                        while wake_r.recv(512):
                            pass
                if front_sock in ready:
                    self._drain_front(p)
                if request_files in ready:
                    p.front.on_stored()
                if journal_synced in ready:
                    p.journal.on_synced()
                if connections in ready:
                    self.auth.on_monitor()
                if cluster_fd in ready and p.cluster is not None:
                    p.cluster.run_done()
                if sink_sock in ready:
                    p.sink.drain(p.driver)
                if workers_sock in ready and p.pool.drain():
                    self._log_ready(p.pool)
                while p.pool.unaccepted:
                    p.driver.on_final_unaccepted(*p.pool.unaccepted.pop())
                if p.logs in ready:
                    self._drain_logs(p.logs)
                if sink_fd in ready:
                    poller.unregister(sink_fd)
                    sink_fd = -1  # none until the new sink starts
                    sink_sock = self._new_sink_socket(p, poller)
                    if not self._sink_died(p):
                        code = 1
                        break
                if zygote_fd in ready and not self._drain_zygote(p):
                    poller.unregister(zygote_fd)
                    zygote_fd = -1
                    if not self._zygote_died(p):
                        code = 1
                        break
                if gateway_fd in ready:
                    poller.unregister(gateway_fd)
                    gateway_fd = -1
                    self._gateway.join(timeout=1.0)
                    if not self._restart_later(self._gateway_restarts, self._gateway.exitcode):
                        code = 1
                        break
                now = time.monotonic()
                if self._gateway_restarts.take_due(now):
                    gateway_fd = self._start_gateway()
                    poller.register(gateway_fd, zmq.POLLIN)
                    p.counters["gateway_restarts"] += 1
                if self._sink_restarts.take_due(now):
                    self._restart_sink(p)
                    sink_fd = self._sink.sentinel
                    poller.register(sink_fd, zmq.POLLIN)
                if self._zygote_restarts.take_due(now):
                    self._restart_zygote(p)
                    zygote_fd = self._zygote_conn.fileno()
                    poller.register(zygote_fd, zmq.POLLIN)
                p.driver.on_timers(now)
                if p.cluster is not None and drain_until is None:
                    p.cluster.tick(now)
                if drain_until is None:
                    # Before the replies: new calls' first attempts join this
                    # turn's journal transaction, so one commit (one fsync)
                    # makes both the calls and their epochs durable.
                    p.driver.schedule()
                p.front.flush_accepts()
                p.clients.expire_waiters(now)
                p.journal.commit()
                p.front.refuse_unstored()
                p.counters["journal_pruned"] += p.journal.prune_tick(self.config.retention_days)
        finally:
            signal.set_wakeup_fd(-1)
            wake_r.close()
            wake_w.close()
            self._shutdown(p)
        return code

    def _sleep_ms(self, p: Parts, drain_until: float | None) -> int:
        """How long the loop may sleep: until the nearest deadline of any owner
        (rounded up to the next ms, so it wakes at or after it)."""
        now = time.monotonic()
        due = [now + IDLE_WAKE_S, p.driver.next_due(), p.clients.next_due(),
               p.pool.next_due(), drain_until, self._sink_restarts.due(),
               self._zygote_restarts.due(), self._gateway_restarts.due(),
               p.journal.retry_due, p.cluster.next_due() if p.cluster is not None else None]
        if self.config.retention_days > 0:
            due.append(p.journal.prune_due)
        nearest = min(d for d in due if d is not None)
        return max(0, math.ceil((nearest - now) * 1000))

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
            user = self.auth.user_of(frames[-1])
            if user is None:
                p.counters["refused.unauthenticated"] += 1
                continue  # a revoked key: no reply, as for a key never registered
            # The body as a view: a large one refused unread is never copied.
            p.front.handle([frames[0].bytes, *(f.buffer for f in frames[1:])], user)

    def _log_ready(self, pool: Pool) -> None:
        if not self._ready_logged and self._zygote_ready:
            self._ready_logged = True
            log.info("ready: endpoint=%s, warm workers=%d", self.config.endpoint,
                     pool.count(WorkerState.IDLE))
            self._notify.ready(f"serving on {self.config.endpoint}")

    @staticmethod
    def _drain_logs(logs: zmq.Socket[bytes]) -> None:
        while True:
            try:
                frame = logs.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = msgpack.unpackb(frame, raw=False)
            if msg and msg[0] == L_RECORD:
                emit_child_record(msg[1])

    def _drain_zygote(self, p: Parts) -> bool:
        conn = self._zygote_conn
        while conn.poll():
            try:
                frame = conn.recv_bytes()
            except (EOFError, OSError):
                return False
            try:
                event = decode_zygote_event(frame)
            except ValueError as exc:
                log.error("%s", exc)
                continue
            if isinstance(event, ZygoteLog):
                emit_child_record(event.fields)
            elif isinstance(event, ZygoteReady):
                self._zygote_ready = True
                self._zygote_restarts.ready()
            elif isinstance(event, WorkerSpawned):
                p.pool.on_spawned(event.worker_id, event.pid)
            elif isinstance(event, WorkerExited):
                worker = p.pool.on_exited(event.worker_id, event.pid, event.returncode)
                if worker is not None:
                    log.debug("worker %d (pid %d) exited with %s", worker.worker_id,
                              worker.pid, exit_text(event.returncode))
                    p.driver.on_worker_exit(worker.call_id, worker.token, event.returncode)
                p.pool.maintain()
        return True

    def _new_sink_socket(self, p: Parts, poller: zmq.Poller) -> zmq.Socket[bytes]:
        """The sink died: what it answered counts; what it had not read goes
        with its connection, so every request failed as lost is lost (queued,
        it would reach the next sink beside the one sent again)."""
        p.sink.drain(p.driver)
        poller.unregister(p.sink.socket)
        p.sink.socket.close()
        p.sink.socket = self._sink_socket()
        poller.register(p.sink.socket, zmq.POLLIN)
        return p.sink.socket

    def _sink_died(self, p: Parts) -> bool:
        """The sink died: fail what it never answered and rebind the attempts
        in flight at once (ARCHITECTURE §2.8), and tell the next sink who
        follows the live calls; what is sent to it now waits in the socket
        until it starts, when its back-off ends. False if it cannot start (the
        daemon stops)."""
        self._sink.join(timeout=1.0)
        if not self._restart_later(self._sink_restarts, self._sink.exitcode):
            return False
        p.driver.on_sink_restart()
        # The new sink knows no subscriber: tell it again who follows the live
        # calls (from now on; a client repairs a gap from its last seq).
        for call_id, listener in p.clients.following():
            p.sink.subscribe(call_id, listener, FROM_NOW, True, lambda _: None)
        return True

    def _restart_sink(self, p: Parts) -> None:
        """Its back-off is over: a new sink on the same store (it rebuilds its
        epochs and each call's last content from it; what the dead one had not
        committed was never published)."""
        self._start_sink()
        p.counters["sink_restarts"] += 1
        self._probe_sink(p.sink)

    def _zygote_died(self, p: Parts) -> bool:
        """The zygote died and its workers with it: their attempts end as killed.
        False if it cannot start (the daemon stops)."""
        self._zygote.join(timeout=1.0)
        self._zygote_conn.close()
        if not self._restart_later(self._zygote_restarts, self._zygote.exitcode):
            return False
        for worker in p.pool.on_zygote_lost():
            p.driver.on_worker_exit(worker.call_id, worker.token, -signal.SIGKILL)
        return True

    def _restart_zygote(self, p: Parts) -> None:
        self._start_zygote()
        p.counters["zygote_restarts"] += 1
        backlog, self._zygote_backlog = self._zygote_backlog, []
        for cmd in backlog:
            self._to_zygote(cmd)
        p.pool.maintain()

    @staticmethod
    def _restart_later(policy: RestartPolicy, returncode: int | None) -> bool:
        """Whether the dead child is started again (its policy logged when)."""
        decision = policy.died(returncode)
        if isinstance(decision, GiveUp):
            log.critical("%s; stopping (the journal keeps every accepted call for the next "
                         "start)", decision.reason)
            return False
        return True

    def _shutdown(self, p: Parts) -> None:
        log.info("stopping")
        self._notify.stopping("stopping")
        self._stop_children()
        p.journal.close()  # before abandon_staged: the accepts a last commit lets go
        p.front.abandon_staged()
        self.auth.close_monitor(p.clients.socket)
        for sock in (p.clients.socket, p.sink.socket, p.pool.socket, p.logs):
            sock.close(linger=0)
        self.auth.stop()
        self.ctx.term()
        p.pool.close()
        if p.cluster is not None:
            p.cluster.close()
        self._lock.release()
        log.info("stopped")

    def _stop_children(self) -> None:
        """Stop the zygote and the sink (SIGTERM, SIGKILL after 5 s) and reap them."""
        with contextlib.suppress(Exception):
            self._to_zygote(StopZygote())
        for proc in (self._gateway, self._zygote, self._sink):
            if proc is not None and proc.is_alive():
                proc.terminate()
        for proc in (self._gateway, self._zygote, self._sink):
            if proc is not None:
                proc.join(timeout=5.0)
                if proc.is_alive():
                    proc.kill()
                    proc.join(timeout=1.0)


def _raise_fd_limit(workers_max: int) -> None:
    """Raise the soft limit on open files to the hard one (the children inherit
    it), and say what it is. The supervisor holds ~2 descriptors per worker
    (measured: 1,044 at 500 workers) and one per client connection, the sink
    one per worker and per events connection: the usual soft limit of 1,024
    runs out at scale, and a process out of descriptors cannot even accept
    the connection that would tell it so."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:  # Linux caps NOFILE at fs.nr_open
        try:
            with open("/proc/sys/fs/nr_open") as f:
                target = int(f.read())
        except (OSError, ValueError):
            target = soft
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-files limit from %d to %d: %s",
                        soft, target, exc)
    shown = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    log.info("open files: soft limit %s (hard %s)", soft, shown)
    want = 256 + 4 * workers_max
    if soft != resource.RLIM_INFINITY and soft < want:
        log.warning("open-files limit %d is low for workers_max=%d; raise the hard limit "
                    "(systemd: LimitNOFILE)", soft, workers_max)
