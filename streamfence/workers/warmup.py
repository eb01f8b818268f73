"""Warm-up: throwaway attempts through the real adapters against a stub
provider served by a thread of this process on 127.0.0.1, so that lazy
imports, caches and (after a fork) copy-on-write pages are paid before a real
call needs them.

- `import_wires(kinds)` then `warm_up(kinds)`, in the zygote before it
  freezes its heap: imports the adapters (and SDKs) of the configured kinds
  only, builds the shared SSL context, one attempt per configured SSE wire,
  and for bedrock loads botocore's service model; a
  failure stops the zygote (its workers would be cold and slow). A kind not
  configured costs nothing here; a worker imports it on its first attempt
  of that kind (workers/registry.py), so a reload that adds one still serves.
- `warm_spare`, in a new spare after its hello (workers/worker.py): one
  attempt per SSE wire the zygote warmed and one TLS handshake of the
  process with itself (workers/tls_warmup.py), best effort, step by step
  on its main thread while no attempt waits. Measured (10 forks each,
  alternated, docs/PERFORMANCE.md): a new worker's first real attempt
  13.6 -> 5.4 ms to the request, for ~20 ms of CPU; its first TLS
  handshake with a provider 2.25 -> 1.3-1.5 ms of CPU.
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import sys
import threading
from collections.abc import Callable, Collection, Generator, Iterator
from typing import Any

from streamfence.protocol.failpoints import ARMED, failpoint
from streamfence.protocol.internal.outcome import AttemptOutcome
from streamfence.protocol.internal.workers import AttemptSettings
from streamfence.workers.registry import imported_kinds
from streamfence.workers.tls_warmup import handshake_with_itself

log = logging.getLogger("streamfence.warmup")

WARM_TIMEOUT_S = 5.0  # the zygote's steps (its warm-up failing stops it)
SPARE_STEP_TIMEOUT_S = 1.0  # a spare's: an attempt may wait for the step under way
_SDKS = ("openai", "anthropic", "botocore")  # the wires' SDKs, as sys.modules names them
_HELLO = {"role": "user", "content": "hi"}
# (kind, path under the stub's base URL, request): the SSE wires.
_WIRES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("openai", "/v1", {"model": "warm", "messages": [_HELLO]}),
    ("anthropic", "", {"model": "warm", "max_tokens": 8, "messages": [_HELLO]}),
)

_OPENAI_STREAM = b"".join(
    b"data: " + part + b"\n\n"
    for part in (
        b'{"id":"w","object":"chat.completion.chunk","created":0,"model":"warm",'
        b'"choices":[{"index":0,"delta":{"role":"assistant","content":"warm"},"finish_reason":null}]}',
        b'{"id":"w","object":"chat.completion.chunk","created":0,"model":"warm",'
        b'"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}',
        b"[DONE]",
    )
)

_ANTHROPIC_STREAM = b"".join(
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


def _answer(server: socket.socket, count: int) -> None:
    """Answer `count` requests on `server` with the canned stream of their wire."""
    for _ in range(count):
        conn, _addr = server.accept()
        with conn:
            conn.settimeout(server.gettimeout())
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
            stub = _ANTHROPIC_STREAM if path.endswith(b"/messages") else _OPENAI_STREAM
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"content-length: %d\r\nconnection: close\r\n\r\n" % len(stub) + stub)


def _serve_stub(server: socket.socket, count: int) -> None:
    with contextlib.suppress(OSError):
        _answer(server, count)


@contextlib.contextmanager
def _stub(count: int, timeout_s: float) -> Iterator[str]:
    """A stub answering `count` requests on a thread; yields its base URL."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(timeout_s)
    thread = threading.Thread(target=_serve_stub, args=(server, count), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        with contextlib.suppress(OSError):
            server.shutdown(socket.SHUT_RDWR)  # wakes the stub's accept if it still waits
        server.close()
        thread.join(timeout_s)


def _wires(kinds: Collection[str]) -> list[tuple[str, str, dict[str, Any]]]:
    return [wire for wire in _WIRES if wire[0] in kinds]


def _attempt(kind: str, url: str, request: dict[str, Any], timeout_s: float) -> None:
    """One attempt of `kind` against the stub at `url`; RuntimeError if it failed."""
    from streamfence.workers.output import RecordingOutput
    from streamfence.workers.registry import adapter_of

    settings = AttemptSettings(connect_timeout_s=timeout_s, read_timeout_s=timeout_s)
    adapter = adapter_of(kind)
    client = adapter.make_client({"name": "warm", "kind": kind, "api_key_env": None,
                                  "base_url": url})
    try:
        outcome: AttemptOutcome = adapter.run(client, request, RecordingOutput(), settings, ())
    finally:
        client.close()
    if not outcome.ok:
        raise RuntimeError(f"the {kind} warm-up attempt failed: {outcome.error}")


def _run_wires(kinds: Collection[str]) -> str:
    """One attempt per SSE wire of `kinds` against a fresh stub; returns the
    stub's base URL (closed by then). RuntimeError if an attempt did not succeed."""
    wires = _wires(kinds)
    with _stub(len(wires), WARM_TIMEOUT_S) as base:
        for kind, path, request in wires:
            _attempt(kind, base + path, request, WARM_TIMEOUT_S)
    return base


def import_wires(kinds: Collection[str]) -> None:
    """In the zygote: import the adapters (and SDKs) of `kinds`, the configured
    profiles' kinds; nothing of another kind."""
    from streamfence.workers.registry import adapter_of

    for kind in kinds:
        adapter_of(kind)  # ValueError for a kind no adapter speaks: the config refuses it first


def warm_up(kinds: Collection[str]) -> None:
    """In the zygote, after `import_wires(kinds)`: the shared SSL context, and
    each kind's streaming path run once."""
    from streamfence.workers.adapter import shared_ssl_context
    from streamfence.workers.registry import adapter_of

    if not kinds:
        return
    shared_ssl_context()
    base = _run_wires(kinds)
    if "bedrock" in kinds:
        # Loads botocore's service model (the costly part) once, for every fork.
        adapter_of("bedrock").make_client({"name": "warm", "kind": "bedrock",
                                           "endpoint_url": base, "region": "us-east-1",
                                           "aws_credentials": "dummy"})


def loaded_sdks() -> list[str]:
    """The provider SDKs this process has imported (what the zygote's "ready"
    line shows, so that a test can tell an unconfigured SDK stayed out)."""
    return [name for name in _SDKS if name in sys.modules]


def _spare_steps() -> Generator[None, None, None]:
    """A spare's warm-up, one step after each yield."""
    kinds = imported_kinds()  # the zygote's kinds: this worker imports no other
    wires = _wires(kinds)
    if wires:  # bedrock alone has none: no stub to serve
        with _stub(len(wires), SPARE_STEP_TIMEOUT_S) as base:
            for kind, path, request in wires:
                yield
                _attempt(kind, base + path, request, SPARE_STEP_TIMEOUT_S)
    if kinds:
        yield
        # Paid here, not on a retry's path to its provider.
        handshake_with_itself(SPARE_STEP_TIMEOUT_S)


def warm_spare(asked: Callable[[], bool]) -> None:
    """In a new spare after its hello, on its main thread: the steps of its
    warm-up (each a few ms, at most SPARE_STEP_TIMEOUT_S), each only while
    `asked()` says no attempt waits. An attempt that comes meanwhile waits
    for the step under way at most, and ends the warm-up (its own run warms
    the worker). Best effort: a failure leaves the worker as it would be
    without it.

    Not a thread of lower priority, as it once was: on a busy machine the
    kernel left such a thread waiting for a core while it held the GIL,
    and the attempt beside it stood still for seconds (a 1.7 s gap in a
    probe with 12 busy processes on 2 cores, 52 ms at equal priority:
    docs/PERFORMANCE.md, "A spare's warm-up and the GIL")."""
    steps = _spare_steps()
    try:
        with contextlib.closing(steps):
            for _ in steps:  # here, before each step
                if ARMED:
                    failpoint("worker.before_warm_up_step")
                if asked():
                    log.debug("warm-up ended early: an attempt came")
                    return
    except Exception as exc:  # an optimization must not stop a worker
        log.debug("worker warm-up failed: %s", exc)
