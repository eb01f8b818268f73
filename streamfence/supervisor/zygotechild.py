"""The supervisor's side of the zygote, the child that forks the warm
workers: starting it, the commands it is sent over its pipe (kept while it
is down, for the next one), and the events it sends back (its log records,
its readiness, each worker spawned and exited).

It is told the configured profiles' kinds, the only SDKs it imports and
warms (workers/warmup.py). A zygote that dies takes its workers with it;
the daemon restarts it with back-off (`restarts`), and the workers'
attempts end as killed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

from streamfence.config.model import DaemonConfig
from streamfence.protocol.internal.workers import (
    WorkerExited,
    WorkerSpawned,
    ZygoteCommand,
    ZygoteLog,
    ZygoteReady,
    decode_zygote_event,
    encode_zygote,
)
from streamfence.supervisor.attempts import AttemptDriver
from streamfence.supervisor.logs import emit_child_record
from streamfence.supervisor.pool import Pool
from streamfence.supervisor.restarts import RestartPolicy
from streamfence.supervisor.worker_states import exit_text

log = logging.getLogger("streamfence.supervisor")


def configured_kinds(config: DaemonConfig) -> tuple[str, ...]:
    """The kinds of the profiles `config` has: the SDKs a zygote imports and warms."""
    return tuple(sorted({profile.kind for profile in config.providers.values()}))


class ZygoteChild:
    """Owns the zygote process, its pipe, the commands asked while it is
    down, and its restart policy."""

    def __init__(self, mp: Any, config: DaemonConfig, runtime_dir: str) -> None:
        self._mp = mp
        self._config = config
        self._runtime_dir = runtime_dir
        self.process: Any = None
        self._conn: Any = None
        self.restarts = RestartPolicy("zygote", time.monotonic)
        self._backlog: list[ZygoteCommand] = []  # asked while the zygote is down

    def start(self) -> None:
        from streamfence.workers.zygote_entry import zygote_main  # no SDK import here

        parent_conn, child_conn = self._mp.Pipe(duplex=True)
        self.process = self._mp.Process(
            target=zygote_main, name="zygote",
            args=(child_conn, self._runtime_dir, self._config.workers_max,
                  logging.getLevelName(self._config.log_level), os.getpid(),
                  configured_kinds(self._config)))
        self.process.start()
        self.restarts.started()
        child_conn.close()
        self._conn = parent_conn

    def reconfigure(self, config: DaemonConfig) -> None:
        """A reload's config: the next zygote (a restart) warms its kinds and
        logs at its level; the running one keeps its own (its workers import
        a new kind on its first attempt: workers/registry.py)."""
        self._config = config

    def fileno(self) -> int:
        """Its pipe's end: readable when it sent something, or died."""
        return int(self._conn.fileno())

    def send(self, cmd: ZygoteCommand) -> None:
        if self.restarts.down:
            self._backlog.append(cmd)  # for the next zygote, once it starts
            return
        # A zygote that just died (its pipe's end not yet seen) forgets what it
        # was asked: the loop sees the end next and forgets the workers too.
        with contextlib.suppress(OSError):
            self._conn.send_bytes(encode_zygote(cmd))

    def send_backlog(self) -> None:
        """A new zygote is up: what was asked while none was."""
        backlog, self._backlog = self._backlog, []
        for cmd in backlog:
            self.send(cmd)

    def drain(self, pool: Pool, driver: AttemptDriver) -> bool:
        """Handle what the zygote sent; False if its pipe ended (it died)."""
        conn = self._conn
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
                self.restarts.ready()
            elif isinstance(event, WorkerSpawned):
                pool.on_spawned(event.worker_id, event.pid)
            elif isinstance(event, WorkerExited):
                worker = pool.on_exited(event.worker_id, event.pid, event.returncode)
                if worker is not None:
                    log.debug("worker %d (pid %d) exited with %s", worker.worker_id,
                              worker.pid, exit_text(event.returncode))
                    driver.on_worker_exit(worker.call_id, worker.token, event.returncode)
                pool.maintain()
        return True

    def reap(self) -> int | None:
        """The zygote died: wait for it, close its pipe; its exit code."""
        self.process.join(timeout=1.0)
        self._conn.close()
        code: int | None = self.process.exitcode
        return code
