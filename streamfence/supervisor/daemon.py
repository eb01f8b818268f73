"""The supervisor: the daemon's main process.

Duties:
1. Own the client-facing ROUTER socket; journal each call durably before
   acknowledging it (streamfence.supervisor.front).
2. Start and watch the sink (the only writer of the transcript) and the
   zygote (which forks the warm workers); every child dies with us
   (parent-death signal), and a dead zygote is restarted.
3. Drive each call's attempts (streamfence.supervisor.attempts): authorize at the sink,
   dispatch to a warm worker, watch liveness, fence then kill, retry.
4. Fan accepted events out to subscribers; re-emit every child's log records.

Signal handlers only set a flag; the loop turns it into the same stop a
client could ask for.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import resource
import secrets
import signal
import time
from typing import Any

import msgpack
import multiprocess
import zmq

from streamfence.protocol.internal import L_RECORD, W_HELLO, W_IDLE, Endpoints
from streamfence.sink.process import run_sink
from streamfence.supervisor.attempts import AttemptDriver
from streamfence.supervisor.breaker import Breakers
from streamfence.supervisor.calls import CallState
from streamfence.supervisor.config import DaemonConfig
from streamfence.supervisor.front import Front
from streamfence.supervisor.journal import Journal
from streamfence.supervisor.logs import emit_child_record
from streamfence.supervisor.pool import Pool, WorkerState
from streamfence.supervisor.recovery import recover_calls
from streamfence.supervisor.sinklink import SinkLink
from streamfence.supervisor.state import DaemonState
from streamfence.workers.liveness import LivenessTable
from streamfence.workers.zygote import zygote_main

log = logging.getLogger("streamfence.supervisor")

TICK_S = 0.02
SINK_RESTARTS_MAX = 5  # within SINK_RESTART_WINDOW_S, else the daemon stops
SINK_RESTART_WINDOW_S = 60.0


class StartupError(Exception):
    pass


class Daemon:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        os.makedirs(config.state_dir, exist_ok=True)
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
        self._sink_deaths: list[float] = []
        self.ctx = zmq.Context()
        # The sink obeys only this identity (passed to it at spawn, never sent).
        self._control_identity = b"sup-" + secrets.token_hex(16).encode()

    # ---- child processes -----------------------------------------------------
    def _start_sink(self) -> None:
        self._sink = self._mp.Process(
            target=run_sink, name="sink",
            args=(self.runtime_dir, self.transcript_path, self.config.log_level,
                  self._control_identity, True))
        self._sink.start()

    def _start_zygote(self) -> None:
        parent_conn, child_conn = self._mp.Pipe(duplex=True)
        self._zygote = self._mp.Process(
            target=zygote_main, name="zygote",
            args=(child_conn, self.runtime_dir, self.config.workers_max,
                  logging.getLevelName(self.config.log_level), os.getpid()))
        self._zygote.start()
        child_conn.close()
        self._zygote_conn = parent_conn
        self._zygote_ready = False

    def _to_zygote(self, msg: list[Any]) -> None:
        self._zygote_conn.send_bytes(msgpack.packb(msg))

    # ---- set-up --------------------------------------------------------------
    def _setup(self) -> DaemonState:
        cfg = self.config
        for name in ("sink.in", "sink.ctl", "workers", "logs"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.runtime_dir, name))
        live = LivenessTable(self.endpoints.liveness_file, cfg.workers_max, create=True)
        workers_sock = self.ctx.socket(zmq.ROUTER)
        workers_sock.linger = 0
        workers_sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        workers_sock.bind(self.endpoints.workers)
        self.logs_sock = self.ctx.socket(zmq.PULL)
        self.logs_sock.linger = 0
        self.logs_sock.bind(self.endpoints.logs)
        front = self.ctx.socket(zmq.ROUTER)
        front.linger = 0
        # Refuse absurd frames at the transport (the peer is cut off), but let
        # moderately oversized ones through so they get a `too_large` reply.
        front.setsockopt(zmq.MAXMSGSIZE, cfg.max_frame_bytes * 4)
        front.sndhwm = 100_000
        try:
            front.bind(cfg.endpoint)
        except zmq.ZMQError as exc:
            raise StartupError(f"cannot bind {cfg.endpoint}: {exc}") from None
        sink_sock = self.ctx.socket(zmq.DEALER)
        sink_sock.setsockopt(zmq.IDENTITY, self._control_identity)
        sink_sock.linger = 0
        sink_sock.sndhwm = 0
        sink_sock.rcvhwm = 0
        sink_sock.connect(self.endpoints.sink_ctl)
        journal = Journal(os.path.join(cfg.state_dir, "journal.db"))
        pool = Pool(self._to_zygote, slots=cfg.workers_max, spare=cfg.workers_spare,
                    max_workers=cfg.workers_max)
        st = DaemonState(config=cfg, journal=journal, pool=pool, sink=None,  # type: ignore[arg-type]
                         live=live, front=front, workers_sock=workers_sock,
                         clock=time.monotonic, rng=random.Random(),
                         breakers=Breakers(cfg.breaker_threshold, cfg.breaker_cooldown_s,
                                           time.monotonic))
        self.driver = AttemptDriver(st)
        self.front = Front(st, self.driver, self.transcript_path)
        st.sink = SinkLink(sink_sock, self.front.on_event, self.driver.on_ended,
                           self.driver.on_final_refused)
        self._start_sink()
        self._start_zygote()
        st.processes.update(supervisor=os.getpid(), sink=self._sink.pid, zygote=self._zygote.pid)
        recover_calls(st, self.transcript_path)
        pool.maintain()
        return st

    # ---- the loop -------------------------------------------------------------
    def request_stop(self, signum: int = 0, frame: Any = None) -> None:
        self._stop = True

    def run(self) -> int:
        _raise_fd_limit(self.config.workers_max)
        st = self._setup()
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        poller = zmq.Poller()
        poller.register(st.front, zmq.POLLIN)
        poller.register(st.sink.socket, zmq.POLLIN)
        poller.register(st.workers_sock, zmq.POLLIN)
        poller.register(self.logs_sock, zmq.POLLIN)
        poller.register(self._zygote_conn.fileno(), zmq.POLLIN)
        zygote_fd = self._zygote_conn.fileno()
        sink_fd = self._sink.sentinel
        poller.register(sink_fd, zmq.POLLIN)
        last_stats = 0.0
        log.info("supervisor up: endpoint=%s state_dir=%s runtime_dir=%s",
                 self.config.endpoint, self.config.state_dir, self.runtime_dir)
        code = 0
        try:
            drain_until: float | None = None
            while True:
                if self._stop and drain_until is None:
                    drain_until = time.monotonic() + self.config.stop_grace_s
                    self.front.accepting = False
                    log.info("stop requested: no new calls; letting %d running attempt(s) "
                             "finish within %.0fs", self._busy_calls(st), self.config.stop_grace_s)
                if drain_until is not None and (self._busy_calls(st) == 0
                                                or time.monotonic() >= drain_until):
                    break
                ready = dict(poller.poll(int(TICK_S * 1000)))
                if st.front in ready:
                    self._drain_front(st)
                if st.sink.socket in ready:
                    st.sink.drain()
                if st.workers_sock in ready:
                    self._drain_workers(st)
                if self.logs_sock in ready:
                    self._drain_logs()
                if sink_fd in ready:
                    poller.unregister(sink_fd)
                    if not self._restart_sink(st):
                        code = 1
                        break
                    sink_fd = self._sink.sentinel
                    poller.register(sink_fd, zmq.POLLIN)
                if zygote_fd in ready and not self._drain_zygote(st):
                    poller.unregister(zygote_fd)
                    self._restart_zygote(st)
                    zygote_fd = self._zygote_conn.fileno()
                    poller.register(zygote_fd, zmq.POLLIN)
                self.front.flush_accepts()
                self.driver.tick_backoffs()
                self.driver.check_stale()
                if drain_until is None:
                    self.driver.schedule()
                self.front.expire_waiters()
                st.journal.commit()
                now = time.monotonic()
                if now - last_stats > 1.0:
                    last_stats = now
                    st.sink.refresh_stats()
        finally:
            self._shutdown(st)
        return code

    @staticmethod
    def _busy_calls(st: DaemonState) -> int:
        """Calls with an attempt in flight (queued and backing-off ones wait in the journal)."""
        return sum(1 for c in st.calls.values()
                   if c.state in (CallState.AUTHORIZING, CallState.RUNNING, CallState.FENCING,
                                  CallState.FINISHING))

    def _drain_front(self, st: DaemonState) -> None:
        for _ in range(1000):
            try:
                frames = st.front.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.front.handle(frames)

    def _drain_workers(self, st: DaemonState) -> None:
        while True:
            try:
                _identity, frame = st.workers_sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = msgpack.unpackb(frame, raw=False)
            if msg[0] == W_HELLO:
                st.pool.on_hello(msg[1], msg[2])
                if not self._ready_logged and self._zygote_ready:
                    self._ready_logged = True
                    log.info("ready: endpoint=%s, warm workers=%d", self.config.endpoint,
                             st.pool.count(WorkerState.IDLE))
            elif msg[0] == W_IDLE:
                st.pool.on_idle(msg[1])

    def _drain_logs(self) -> None:
        while True:
            try:
                frame = self.logs_sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = msgpack.unpackb(frame, raw=False)
            if msg and msg[0] == L_RECORD:
                emit_child_record(msg[1])

    def _drain_zygote(self, st: DaemonState) -> bool:
        conn = self._zygote_conn
        while conn.poll():
            try:
                msg = msgpack.unpackb(conn.recv_bytes(), raw=False)
            except (EOFError, OSError):
                return False
            kind = msg[0]
            if kind == "log":
                emit_child_record(msg[1])
            elif kind == "ready":
                self._zygote_ready = True
            elif kind == "spawned":
                st.pool.on_spawned(msg[1], msg[2])
            elif kind == "exited":
                worker = st.pool.on_exited(msg[1], msg[2], msg[3])
                if worker is not None:
                    log.debug("worker %d (pid %d) exited with %d", worker.worker_id,
                              worker.pid, msg[3])
                    self.driver.on_worker_exit(worker.call_id, worker.token, msg[3])
                st.pool.maintain()
        return True

    def _restart_sink(self, st: DaemonState) -> bool:
        """The sink died: start a new one on the same store, and fence every
        attempt in flight (the new sink rebuilds its epochs and each call's
        last content from the store; what it had not committed was never
        published). False if the sink is crash-looping."""
        self._sink.join(timeout=1.0)
        now = time.monotonic()
        self._sink_deaths = [t for t in self._sink_deaths if now - t < SINK_RESTART_WINDOW_S]
        self._sink_deaths.append(now)
        if len(self._sink_deaths) > SINK_RESTARTS_MAX:
            log.critical("the sink died %d times in %.0fs; stopping (the journal keeps every "
                         "accepted call for the next start)", len(self._sink_deaths),
                         SINK_RESTART_WINDOW_S)
            return False
        log.error("the sink exited (code %s); restarting it and retrying the attempts in "
                  "flight", self._sink.exitcode)
        self._start_sink()
        st.processes["sink"] = self._sink.pid
        st.counters["sink_restarts"] += 1
        self.driver.on_sink_restart()
        return True

    def _restart_zygote(self, st: DaemonState) -> None:
        log.error("the zygote exited (code %s); its workers die with it; restarting it",
                  self._zygote.exitcode)
        self._zygote.join(timeout=1.0)
        for worker in list(st.pool.workers.values()):
            st.pool.on_exited(worker.worker_id, worker.pid, -9)
            self.driver.on_worker_exit(worker.call_id, worker.token, -9)
        self._start_zygote()
        st.processes["zygote"] = self._zygote.pid
        st.pool.maintain()

    def _shutdown(self, st: DaemonState) -> None:
        log.info("stopping")
        with contextlib.suppress(Exception):
            self._to_zygote(["stop"])
        for proc in (self._zygote, self._sink):
            if proc is not None and proc.is_alive():
                proc.terminate()
        for proc in (self._zygote, self._sink):
            if proc is not None:
                proc.join(timeout=5.0)
                if proc.is_alive():
                    proc.kill()
                    proc.join(timeout=1.0)
        st.journal.close()
        for sock in (st.front, st.sink.socket, st.workers_sock, self.logs_sock):
            sock.close(linger=0)
        self.ctx.term()
        st.live.close()
        log.info("stopped")


def _raise_fd_limit(workers_max: int) -> None:
    """The supervisor holds ~2 descriptors per worker (measured: 1,044 at 500
    workers), over the usual soft limit of 1,024: raise the soft limit
    towards the hard one rather than fail at scale."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 256 + 4 * workers_max
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < want:
            log.warning("file descriptor limit %d is low for workers_max=%d; raise the hard "
                        "limit (systemd: LimitNOFILE)", new, workers_max)
