"""The zygote: a warmed template process that forks workers.

Why: importing a provider SDK costs ~0.5-2 s and up to ~110 MiB per process
(openai + anthropic + botocore together ~2 s); a spawned worker pays it all,
a forked one shares it. The zygote pays once, for the kinds of the profiles
configured when it starts only (workers/warmup.py `warm_up`): it imports
their adapters and SDKs, builds the shared SSL context, runs each configured
SSE wire's streaming path once against a stub on 127.0.0.1 (so lazy imports
and caches are hot), then `gc.collect(); gc.freeze()` so the children's
garbage collector never touches (and so never copies) the inherited pages.
The collector is off during the imports, whose objects are frozen as they
stand: collecting them as they came (~40 collections, four of them full,
the last over ~230k objects) took ~0.15 s of a one-wire start and ~0.5 s
of a three-wire start here.
A kind a reload adds later is imported by each worker on its first attempt
of that kind (workers/registry.py); the next zygote (a restart) warms it.

Then it collapses its heap into transparent huge pages (MADV_COLLAPSE, Linux
6.1+, best effort): a fork copies one page-table entry per 2 MiB instead of
512. Measured: 7.6 -> 2.7 ms per fork alone, and the zygote's CPU for a
burst's 31 forks 280-330 -> 115 ms (it forks serially, so this paces a
burst's new workers). A write in a child still copies only its 4 KiB page
(anonymous THP copy-on-write splits the mapping, Linux 5.8+), so a worker's
memory is unchanged (USS 9.4 MiB after a stream, either way).

The zygote owns no ZeroMQ context: a context must not cross a fork. It talks
to the supervisor over a pipe (the zygote pipe's messages of
protocol/internal/workers.py):
it forks on SpawnWorker (every command already waiting, back to back),
answers WorkerSpawned, and reaps its children, reporting WorkerExited
(negative return code: killed by that signal). Its own log records travel the
same pipe as ZygoteLog.

A new worker's first attempt costs ~8 ms more CPU and wall time than its
later ones (copy-on-write faults and first-use paths after the fork: 13.6 vs
5.4 ms to the request). A spare (SpawnWorker.warm: the pool forks it ahead of
need, no call waits for it) therefore runs one throwaway attempt per SSE wire
against a stub in its own process right after its hello, so the call that
later reserves it does not pay that. A worker forked for a call that is
already waiting skips it: the warm-up costs ~20 ms CPU (both wires, measured)
and saves that call only ~8 ms.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import select
import signal
import time
from typing import Any

from streamfence.protocol.internal.workers import (
    SpawnWorker,
    StopZygote,
    WorkerExited,
    WorkerSpawned,
    ZygoteLog,
    ZygoteReady,
    decode_zygote_command,
    encode_zygote,
)
from streamfence.protocol.lifecycle import ExitCode, die_with_parent, set_process_title
from streamfence.protocol.logs import set_level
from streamfence.workers.warmup import import_wires, loaded_sdks, warm_up
from streamfence.workers.worker import worker_main

log = logging.getLogger("streamfence.zygote")

_MADV_COLLAPSE = 25  # linux/mman.h (6.1+)
_HUGE_PAGE = 2 << 20

class _PipeLogHandler(logging.Handler):
    """Ships the zygote's log records to the supervisor over its pipe."""

    def __init__(self, send: Any) -> None:
        super().__init__()
        self._send = send

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._send(encode_zygote(ZygoteLog({
                "name": record.name, "levelno": record.levelno, "levelname": record.levelname,
                "msg": record.getMessage(), "created": record.created, "process": record.process,
                "processName": "zygote", "exc_text": logging.Formatter().formatException(
                    record.exc_info) if record.exc_info else None,
                "session_id": None, "call_id": None, "attempt": None})))
        except Exception:
            self.handleError(record)


def zygote_main(conn: Any, runtime_dir: str, slots: int, log_level: int,
                parent_pid: int, kinds: tuple[str, ...]) -> None:
    """Entry point (started with the spawn method by the supervisor); `kinds`:
    the configured profiles' kinds, the only SDKs it imports and warms."""
    if not die_with_parent(parent_pid):
        os._exit(ExitCode.PARENT_GONE)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides when we stop
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closing terminal's too (the workers inherit it)
    set_process_title("zygote")
    logging.getLogger().handlers[:] = [_PipeLogHandler(conn.send_bytes)]
    set_level(log_level)
    started = time.monotonic()
    try:
        gc.disable()  # the modules' objects live as long as the process: never scan them
        import_wires(kinds)
        gc.freeze()
        gc.enable()
        imported = time.monotonic()
        warm_up(kinds)
    except Exception:
        log.exception("zygote warm-up failed")
        os._exit(ExitCode.BOOT_FAILED)
    gc.collect()
    gc.freeze()
    collapsed = collapse_to_huge_pages()
    log.info("zygote ready in %.2fs (SDK imports %.2fs, then warm-up, gc.freeze and %d MiB "
             "in huge pages %.2fs; SDKs loaded: %s)", time.monotonic() - started,
             imported - started, collapsed >> 20, time.monotonic() - imported,
             ", ".join(loaded_sdks()) or "none")
    conn.send_bytes(encode_zygote(ZygoteReady(os.getpid())))
    _serve(conn, runtime_dir, slots, log_level)


def _serve(conn: Any, runtime_dir: str, slots: int, log_level: int) -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    children: dict[int, int] = {}  # pid -> worker id
    while True:
        # No timeout: SIGCHLD (through the wake-up pipe), a command, or the
        # supervisor's end of the pipe closing wakes us; idle, we sleep.
        readable, _, _ = select.select([conn.fileno(), wake_r], [], [])
        if wake_r in readable:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
        _reap(conn, children)
        if conn.fileno() not in readable:
            continue
        spawns, stop = _commands(conn)
        if stop:
            break
        for cmd in spawns:
            pid = _fork_worker(conn, wake_r, wake_w, cmd, runtime_dir, slots, log_level)
            children[pid] = cmd.worker_id
            conn.send_bytes(encode_zygote(WorkerSpawned(cmd.worker_id, pid)))
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    os._exit(ExitCode.OK)


def _commands(conn: Any) -> tuple[list[SpawnWorker], bool]:
    """Every command waiting in the pipe (at least one): the spawns, and whether
    to stop (a StopZygote, or the supervisor gone)."""
    spawns: list[SpawnWorker] = []
    while True:
        try:
            frame = conn.recv_bytes()
        except (EOFError, OSError):
            return spawns, True  # the supervisor is gone
        try:
            cmd = decode_zygote_command(frame)
        except ValueError:
            log.exception("ignoring a malformed frame from the supervisor")
        else:
            if isinstance(cmd, StopZygote):
                return spawns, True
            spawns.append(cmd)
        if not conn.poll():
            return spawns, False


def _reap(conn: Any, children: dict[int, int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn.send_bytes(encode_zygote(WorkerExited(children.pop(pid, -1), pid,
                                                   os.waitstatus_to_exitcode(status))))


def _fork_worker(conn: Any, wake_r: int, wake_w: int, cmd: SpawnWorker, runtime_dir: str,
                 slots: int, log_level: int) -> int:
    zygote_pid = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    # Child: drop the zygote's plumbing, then become a worker.
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.close(wake_r)
        os.close(wake_w)
        conn.close()
        # The pipe's log handler is closed with it; worker_main routes the records.
        logging.getLogger().handlers[:] = [logging.NullHandler()]
        if not die_with_parent(zygote_pid):
            os._exit(ExitCode.PARENT_GONE)
        worker_main(cmd.worker_id, cmd.slot, runtime_dir, slots, log_level, cmd.warm)
    finally:
        os._exit(ExitCode.BOOT_FAILED)


# ---- in the zygote and in each new worker: the costs of a fork -------------------

def collapse_to_huge_pages() -> int:
    """MADV_COLLAPSE the 2 MiB-aligned parts of the private anonymous mappings
    (the Python heap): fewer page-table entries for each fork to copy. Best
    effort (older kernels and THP "never" refuse it: nothing changes). Returns
    the bytes collapsed."""
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise.restype = ctypes.c_int
        with open("/proc/self/maps") as maps:
            lines = maps.readlines()
    except (OSError, AttributeError):
        return 0
    collapsed = 0
    for line in lines:
        fields = line.split()
        if len(fields) < 5 or fields[1] != "rw-p" or (len(fields) > 5 and fields[5] != "[heap]"):
            continue
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        start, end = -(-lo // _HUGE_PAGE) * _HUGE_PAGE, hi // _HUGE_PAGE * _HUGE_PAGE
        if end > start and madvise(start, end - start, _MADV_COLLAPSE) == 0:
            collapsed += end - start
    return collapsed
