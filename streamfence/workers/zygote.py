"""The zygote: a warmed template process that forks workers.

Why: importing openai + anthropic + boto3 + httpx2 + zmq costs ~2 s and
~110 MiB per process; a spawned worker pays it all, a forked one shares it.
The zygote pays once: it imports everything, builds the shared SSL context,
runs the SDK streaming path once against a stub on 127.0.0.1 (so lazy imports
and caches are hot), then `gc.collect(); gc.freeze()` so the children's
garbage collector never touches (and so never copies) the inherited pages.

Then it collapses its heap into transparent huge pages (MADV_COLLAPSE, Linux
6.1+, best effort): a fork copies one page-table entry per 2 MiB instead of
512. Measured: 7.6 -> 2.7 ms per fork alone, and the zygote's CPU for a
burst's 31 forks 280-330 -> 115 ms (it forks serially, so this paces a
burst's new workers). A write in a child still copies only its 4 KiB page
(anonymous THP copy-on-write splits the mapping, Linux 5.8+), so a worker's
memory is unchanged (USS 9.4 MiB after a stream, either way).

The zygote owns no ZeroMQ context: a context must not cross a fork. It talks
to the supervisor over a pipe (the zygote-pipe messages of protocol/internal.py):
it forks on SpawnWorker (every command already waiting, back to back),
answers WorkerSpawned, and reaps its children, reporting WorkerExited
(negative return code: killed by that signal). Its own log records travel the
same pipe as ZygoteLog.

A new worker's first attempt costs ~8 ms more CPU and wall time than its
later ones (copy-on-write faults and first-use paths after the fork: 13.6 vs
5.4 ms to the request). A worker forked alone or in a pair (a spare, the
replacement of a killed worker) therefore runs one throwaway attempt per SSE
wire against a stub in its own process before it says hello, so the call that
reserves it (a retry, the first of a burst) does not pay that. A worker forked
in a run of more (a burst: calls are already waiting for it) skips it: the
warm-up costs ~20 ms CPU (both wires, measured) and saves the first attempt
only ~8 ms, so in a burst it would delay every call behind it.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import re
import select
import signal
import socket
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from streamfence.protocol.internal.workers import (
    AttemptSettings,
    SpawnWorker,
    StopZygote,
    WorkerExited,
    WorkerSpawned,
    ZygoteLog,
    ZygoteReady,
    decode_zygote_command,
    encode_zygote,
)
from streamfence.protocol.lifecycle import ExitCode, die_with_parent

log = logging.getLogger("streamfence.zygote")

# A new worker warms up unless it is one of more than WARM_RUN_MAX forks within
# WARM_WINDOW_S (a burst: its call is waiting, it pays its first-use costs there).
WARM_RUN_MAX = 2
WARM_WINDOW_S = 0.5
WARM_TIMEOUT_S = 5.0
_MADV_COLLAPSE = 25  # linux/mman.h (6.1+)
_HUGE_PAGE = 2 << 20

_STUB_BODY = b"".join(
    b"data: " + part + b"\n\n"
    for part in (
        b'{"id":"w","object":"chat.completion.chunk","created":0,"model":"warm",'
        b'"choices":[{"index":0,"delta":{"role":"assistant","content":"warm"},"finish_reason":null}]}',
        b'{"id":"w","object":"chat.completion.chunk","created":0,"model":"warm",'
        b'"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}',
        b"[DONE]",
    )
)


_ANTHROPIC_STUB_BODY = b"".join(
    b"event: " + name + b"\ndata: " + data + b"\n\n"
    for name, data in (
        (b"message_start", b'{"type":"message_start","message":{"id":"w","type":"message",'
                           b'"role":"assistant","model":"warm","content":[],"stop_reason":null,'
                           b'"usage":{"input_tokens":1,"output_tokens":0}}}'),
        (b"content_block_start", b'{"type":"content_block_start","index":0,'
                                 b'"content_block":{"type":"text","text":""}}'),
        (b"content_block_delta", b'{"type":"content_block_delta","index":0,'
                                 b'"delta":{"type":"text_delta","text":"warm"}}'),
        (b"content_block_stop", b'{"type":"content_block_stop","index":0}'),
        (b"message_delta", b'{"type":"message_delta","delta":{"stop_reason":"end_turn"},'
                           b'"usage":{"output_tokens":1}}'),
        (b"message_stop", b'{"type":"message_stop"}'),
    )
)


class _StubHandler(BaseHTTPRequestHandler):
    """The warm-up's provider: one canned stream per wire."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        body = _ANTHROPIC_STUB_BODY if self.path.endswith("/messages") else _STUB_BODY
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


HELLO = {"role": "user", "content": "hi"}


def warm_up() -> None:
    """Import everything and run each SDK's streaming path once, locally, through
    the adapters' public interface."""
    import boto3  # noqa: F401  (imported for its pages, used by workers)
    import zmq  # noqa: F401

    from streamfence.workers import worker  # noqa: F401
    from streamfence.workers.adapter import shared_ssl_context
    from streamfence.workers.output import RecordingOutput
    from streamfence.workers.registry import ADAPTERS

    shared_ssl_context()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StubHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        settings = AttemptSettings(connect_timeout_s=5.0, read_timeout_s=5.0)
        for kind, base_url, request in (
                ("openai", base + "/v1", {"model": "warm", "messages": [HELLO]}),
                ("anthropic", base, {"model": "warm", "max_tokens": 8, "messages": [HELLO]})):
            adapter = ADAPTERS[kind]
            client = adapter.make_client({"name": "warm", "kind": kind, "api_key_env": None,
                                          "base_url": base_url})
            try:
                outcome = adapter.run(client, request, RecordingOutput(), settings, ())
            finally:
                client.close()
            if not outcome.ok:
                raise RuntimeError(f"the {kind} warm-up attempt failed: {outcome.error}")
        # Loads botocore's service model (the costly part) once, for every fork.
        ADAPTERS["bedrock"].make_client({"name": "warm", "kind": "bedrock", "endpoint_url": base,
                                         "region": "us-east-1", "aws_credentials": "dummy"})
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


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
                "session_id": "-", "call_id": "-", "attempt": 0})))
        except Exception:
            self.handleError(record)


def zygote_main(conn: Any, runtime_dir: str, slots: int, log_level: int,
                parent_pid: int) -> None:
    """Entry point (started with the spawn method by the supervisor)."""
    if not die_with_parent(parent_pid):
        os._exit(ExitCode.PARENT_GONE)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides when we stop
    root = logging.getLogger()
    root.handlers[:] = [_PipeLogHandler(conn.send_bytes)]
    root.setLevel(log_level)
    started = time.monotonic()
    try:
        warm_up()
    except Exception:
        log.exception("zygote warm-up failed")
        os._exit(ExitCode.BOOT_FAILED)
    gc.collect()
    gc.freeze()
    collapsed = collapse_to_huge_pages()
    log.info("zygote ready in %.2fs (%d MiB in huge pages)", time.monotonic() - started,
             collapsed >> 20)
    conn.send_bytes(encode_zygote(ZygoteReady(os.getpid())))
    _serve(conn, runtime_dir, slots, log_level)


def _serve(conn: Any, runtime_dir: str, slots: int, log_level: int) -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    children: dict[int, int] = {}  # pid -> worker id
    recent: deque[float] = deque()  # when the forks of the last WARM_WINDOW_S were made
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
        now = time.monotonic()
        while recent and now - recent[0] > WARM_WINDOW_S:
            recent.popleft()
        warm = len(recent) + len(spawns) <= WARM_RUN_MAX
        for cmd in spawns:
            pid = _fork_worker(conn, wake_r, wake_w, cmd, runtime_dir, slots, log_level, warm)
            recent.append(time.monotonic())
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
                 slots: int, log_level: int, warm: bool) -> int:
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
        if warm:
            warm_worker()
        from streamfence.workers.worker import worker_main

        worker_main(cmd.worker_id, cmd.slot, runtime_dir, slots, log_level)
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


def _serve_stub(server: socket.socket, count: int) -> None:
    """Answer `count` requests on `server` with the canned stream of their wire."""
    with contextlib.suppress(OSError):
        _answer(server, count)


def _answer(server: socket.socket, count: int) -> None:
    for _ in range(count):
        conn, _addr = server.accept()
        with conn:
            conn.settimeout(WARM_TIMEOUT_S)
            data = b""
            while b"\r\n\r\n" not in data:
                piece = conn.recv(65536)
                if not piece:
                    return
                data += piece
            head, _, body = data.partition(b"\r\n\r\n")
            length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
            while length is not None and len(body) < int(length.group(1)):
                piece = conn.recv(65536)
                if not piece:
                    return
                body += piece
            path = head.split(b" ", 2)[1]
            stub = _ANTHROPIC_STUB_BODY if path.endswith(b"/messages") else _STUB_BODY
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"content-length: %d\r\nconnection: close\r\n\r\n" % len(stub) + stub)


def warm_worker() -> None:
    """In a new worker, before its hello: one throwaway attempt per SSE wire
    (openai, anthropic) through a throwaway client against a stub served by a
    thread of this process. Measured (10 forks each, alternated, in
    docs/PERFORMANCE.md): the first real attempt 13.6 -> 5.4 ms to the request.
    Best effort: a failure leaves the worker as it would be without it."""
    from streamfence.workers.output import RecordingOutput
    from streamfence.workers.registry import ADAPTERS

    wires = (("openai", "/v1", {"model": "warm", "messages": [HELLO]}),
             ("anthropic", "", {"model": "warm", "max_tokens": 8, "messages": [HELLO]}))
    try:
        server = socket.create_server(("127.0.0.1", 0))
    except OSError:
        return
    server.settimeout(WARM_TIMEOUT_S)
    thread = threading.Thread(target=_serve_stub, args=(server, len(wires)), daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.getsockname()[1]}"
    settings = AttemptSettings(connect_timeout_s=WARM_TIMEOUT_S, read_timeout_s=WARM_TIMEOUT_S)
    try:
        for kind, path, request in wires:
            adapter = ADAPTERS[kind]
            client = adapter.make_client({"name": "warm", "kind": kind, "api_key_env": None,
                                          "base_url": base + path})
            try:
                adapter.run(client, request, RecordingOutput(), settings, ())
            finally:
                client.close()
    except Exception as exc:  # an optimization must not stop a worker
        log.debug("worker warm-up failed: %s", exc)
    finally:
        with contextlib.suppress(OSError):
            server.shutdown(socket.SHUT_RDWR)  # wakes the stub's accept if it still waits
        server.close()
        thread.join(WARM_TIMEOUT_S)
