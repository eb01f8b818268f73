"""The zygote: a warmed template process that forks workers.

Why: importing openai + anthropic + boto3 + httpx2 + zmq costs ~2 s and
~110 MiB per process; a spawned worker pays it all, a forked one shares it.
The zygote pays once: it imports everything, builds the shared SSL context,
runs the SDK streaming path once against a stub on 127.0.0.1 (so lazy imports
and caches are hot), then `gc.collect(); gc.freeze()` so the children's
garbage collector never touches (and so never copies) the inherited pages.

The zygote owns no ZeroMQ context: a context must not cross a fork. It talks
to the supervisor over a pipe (the zygote-pipe messages of protocol/internal.py):
it forks on SpawnWorker, answers WorkerSpawned, and reaps its children,
reporting WorkerExited (negative return code: killed by that signal). Its own
log records travel the same pipe as ZygoteLog.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import select
import signal
import threading
import time
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
    log.info("zygote ready in %.2fs", time.monotonic() - started)
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
        readable, _, _ = select.select([conn.fileno(), wake_r], [], [], 1.0)
        if wake_r in readable:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
        _reap(conn, children)
        if conn.fileno() in readable:
            try:
                frame = conn.recv_bytes()
            except (EOFError, OSError):
                break  # the supervisor is gone
            try:
                cmd = decode_zygote_command(frame)
            except ValueError:
                log.exception("ignoring a malformed frame from the supervisor")
                continue
            if isinstance(cmd, StopZygote):
                break
            pid = _fork_worker(conn, wake_r, wake_w, cmd, runtime_dir, slots, log_level)
            children[pid] = cmd.worker_id
            conn.send_bytes(encode_zygote(WorkerSpawned(cmd.worker_id, pid)))
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    os._exit(ExitCode.OK)


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
        if not die_with_parent(zygote_pid):
            os._exit(ExitCode.PARENT_GONE)
        from streamfence.workers.worker import worker_main

        worker_main(cmd.worker_id, cmd.slot, runtime_dir, slots, log_level)
    finally:
        os._exit(ExitCode.BOOT_FAILED)
