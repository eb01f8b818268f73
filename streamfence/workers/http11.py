"""HTTP/1.1 for the workers' SDK clients: httpx2's requests and responses,
each response parsed by llhttp (`httptools`).

Why not httpx2's own transport: at a model's pace each provider read comes
alone after a sleep, and h11's state machine with httpcore's layers around
it cost the worker ~110-150 µs of CPU per read on cold caches, more than the
rest of what it does per delta; llhttp parses the same read in C
(docs/PERFORMANCE.md, "Issue 32: the worker's read").

What it does: HTTP/1.1 over TCP, or TLS with the client's SSL context; one
request at a time per connection; up to `keepalive` idle connections kept
per origin, one that turned readable while idle (closed by the server) or
idle longer than `keepalive_s` never reused, and one whose stream the SDK
closed at its last event kept if the body's end has arrived (`_Body.close`;
httpx's transport drops it, so the bare openai SDK makes a connection per
streamed call); the request's `timeout`
extension for the connect and TLS handshake, the request's send and each
read; failures raised as httpx2's exceptions (what workers/errors.py
classifies). What it leaves out, since no worker client uses it: proxies,
HTTP/2, `Expect: 100-continue` (an interim 1xx response is skipped), and a
limit on connections (a worker runs one attempt at a time). It is where an
attempt waits for its W_GO (workers/send_gate.py), once it has a connection.
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from typing import Any

import httptools
import httpx2

from streamfence.workers.send_gate import GATE

__all__ = ["Http11Transport"]

READ_SIZE = 65536


class _Message:
    """httptools' callbacks for one response: what the parser has seen so far."""

    __slots__ = ("body", "complete", "head_done", "headers", "keep_alive", "parser", "reason")

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.on_message_begin()

    def on_message_begin(self) -> None:  # also after an interim 1xx, on the same parser
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.body: list[bytes] = []  # parsed body bytes not yet handed on
        self.complete = False
        self.keep_alive = False

    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.head_done = True
        # Asked now: once the message is complete the parser has reset for the next.
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True


def _readable(sock: socket.socket) -> bool:
    """Whether `sock` has something to read, or its peer hung up (poll, not
    select: a worker's descriptors may number above select's 1024)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def _timeout(request: httpx2.Request, which: str) -> float | None:
    value = (request.extensions.get("timeout") or {}).get(which)
    return None if value is None else float(value)


def _head(request: httpx2.Request) -> bytes:
    """The request line and headers (httpx2 has added Host and the body's length)."""
    lines = [request.method.encode("ascii"), b" ", request.url.raw_path, b" HTTP/1.1\r\n"]
    for name, value in request.headers.raw:
        lines += (name, b": ", value, b"\r\n")
    lines.append(b"\r\n")
    head = b"".join(lines)
    lines_end = len(request.headers.raw) + 2  # the request line, each header, the blank line
    if not head.count(b"\r") == head.count(b"\n") == head.count(b"\r\n") == lines_end:
        raise httpx2.LocalProtocolError("a line break inside the request line or a header",
                                        request=request)
    return head


class _Body(httpx2.SyncByteStream):
    """A response's body, one piece per read of the connection; the connection
    goes back to its transport when the body was read whole and may be kept."""

    def __init__(self, transport: Http11Transport, origin: tuple[bytes, bytes, int],
                 sock: socket.socket, message: _Message, request: httpx2.Request, chunked: bool,
                 until_close: bool) -> None:
        self._transport, self._origin, self._sock = transport, origin, sock
        self._message, self._request = message, request
        self._chunked, self._until_close = chunked, until_close
        self._closed = False

    def __iter__(self) -> Iterator[bytes]:
        message, request = self._message, self._request
        body = message.body  # what the parser took from each read (the head's too)
        recv, feed = self._sock.recv, message.parser.feed_data
        while True:
            if body:
                piece = body[0] if len(body) == 1 else b"".join(body)
                body.clear()
                yield piece
            if message.complete:
                return
            try:
                data = recv(READ_SIZE)
                if not data:
                    if self._until_close:
                        message.complete = True  # the body ends where the connection does
                        return
                    raise httpx2.RemoteProtocolError(
                        "peer closed connection without sending complete message body ("
                        + ("incomplete chunked read)" if self._chunked else "incomplete body)"),
                        request=request)
                feed(data)
            except TimeoutError as exc:
                raise httpx2.ReadTimeout(str(exc) or "timed out", request=request) from exc
            except OSError as exc:
                raise httpx2.ReadError(str(exc), request=request) from exc
            except httptools.HttpParserError as exc:
                raise httpx2.RemoteProtocolError(f"malformed response body: {exc}",
                                                 request=request) from exc

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # (llhttp's keep-alive is already False for a body that ends with the connection)
        if not self._message.complete and self._message.keep_alive and not self._until_close:
            self._read_the_end_if_here()
        if self._message.complete and self._message.keep_alive:
            self._transport.keep(self._origin, self._sock)
        else:
            self._sock.close()

    def _read_the_end_if_here(self) -> None:
        """The SDK closes a stream at its last event (openai's `[DONE]`), and over
        TLS the body's end (the chunked terminator) often comes in a record of
        its own, unread then: a connection closed for it costs the worker's next
        attempt a new TCP and TLS handshake (httpx's own transport drops it so).
        Read what has arrived, never waiting, and keep the connection if that
        ends the message; a body that goes on is not drained."""
        feed = self._message.parser.feed_data
        try:
            self._sock.settimeout(0.0)
            for _ in range(4):
                data = self._sock.recv(READ_SIZE)  # nothing there: an OSError
                if not data:
                    return
                feed(data)
                if self._message.complete:
                    return
        except (OSError, httptools.HttpParserError):
            return


class Http11Transport(httpx2.BaseTransport):
    """An httpx2 transport speaking HTTP/1.1 with llhttp as its response parser
    (module docstring)."""

    def __init__(self, ssl_context: ssl.SSLContext, keepalive: int = 2,
                 keepalive_s: float = 5.0) -> None:
        self._ssl_context = ssl_context
        self._keepalive, self._keepalive_s = keepalive, keepalive_s
        self._idle: dict[tuple[bytes, bytes, int], list[tuple[socket.socket, float]]] = {}
        self._lock = threading.Lock()

    # ---- connections ----------------------------------------------------------
    def keep(self, origin: tuple[bytes, bytes, int], sock: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(origin, [])
            if len(idle) < self._keepalive:
                idle.append((sock, time.monotonic()))
                return
        sock.close()

    def _kept(self, origin: tuple[bytes, bytes, int]) -> socket.socket | None:
        """An idle connection to `origin` still fit to carry a request, if any."""
        now = time.monotonic()
        while True:
            with self._lock:
                idle = self._idle.get(origin)
                if not idle:
                    return None
                sock, since = idle.pop()
            # Readable while idle: the server closed it (or sent what no request asked for).
            if now - since < self._keepalive_s and not _readable(sock):
                return sock
            sock.close()

    def _connect(self, origin: tuple[bytes, bytes, int], request: httpx2.Request) -> socket.socket:
        scheme, host, port = origin
        name = host.decode("ascii")
        timeout = _timeout(request, "connect")
        try:
            sock = socket.create_connection((name, port), timeout=timeout)
        except TimeoutError as exc:
            raise httpx2.ConnectTimeout(str(exc) or "timed out", request=request) from exc
        except OSError as exc:
            raise httpx2.ConnectError(str(exc), request=request) from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if scheme == b"https":
            try:
                sock = self._ssl_context.wrap_socket(sock, server_hostname=name)
            except TimeoutError as exc:
                sock.close()
                raise httpx2.ConnectTimeout(str(exc) or "timed out", request=request) from exc
            except OSError as exc:  # ssl.SSLError is an OSError
                sock.close()
                raise httpx2.ConnectError(str(exc), request=request) from exc
        return sock

    def _socket_for(self, origin: tuple[bytes, bytes, int],
                    request: httpx2.Request) -> socket.socket:
        """A connection for the request, past the attempt's send gate
        (workers/send_gate.py). While this thread's attempt awaits its word, a
        new connection is opened unless one is kept (a kept one is taken after
        the word: it may close meanwhile). Nothing is sent before the word;
        dropped, the attempt leaves its new connection kept, clean."""
        if GATE.shut():
            with self._lock:
                kept = bool(self._idle.get(origin))
            fresh = None if kept else self._connect(origin, request)
            try:
                GATE.wait()
            except BaseException:
                if fresh is not None:
                    self.keep(origin, fresh)
                raise
            if fresh is not None:
                return fresh
        return self._kept(origin) or self._connect(origin, request)

    # ---- one request ----------------------------------------------------------
    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        url = request.url
        if url.raw_scheme not in (b"http", b"https"):
            raise httpx2.UnsupportedProtocol(f"unsupported URL scheme {url.scheme!r}",
                                             request=request)
        origin = (url.raw_scheme, url.raw_host,
                  url.port or (443 if url.raw_scheme == b"https" else 80))
        data = _head(request) + request.read()
        sock = self._socket_for(origin, request)
        try:
            return self._exchange(origin, sock, request, data)
        except BaseException:
            sock.close()
            raise

    def _exchange(self, origin: tuple[bytes, bytes, int], sock: socket.socket,
                  request: httpx2.Request, data: bytes) -> httpx2.Response:
        try:
            sock.settimeout(_timeout(request, "write"))
            sock.sendall(data)
        except TimeoutError as exc:
            raise httpx2.WriteTimeout(str(exc) or "timed out", request=request) from exc
        except OSError as exc:
            raise httpx2.WriteError(str(exc), request=request) from exc
        message = _Message()
        parser = message.parser
        try:
            sock.settimeout(_timeout(request, "read"))
            while True:
                chunk = sock.recv(READ_SIZE)
                if not chunk:
                    raise httpx2.RemoteProtocolError(
                        "Server disconnected without sending a response.", request=request)
                parser.feed_data(chunk)
                if message.head_done:
                    status = parser.get_status_code()
                    if status >= 200:
                        break
                    if status == 101:
                        raise httpx2.RemoteProtocolError("the server switched protocols",
                                                         request=request)
                    message.head_done = False  # an interim 1xx: the final response follows
        except TimeoutError as exc:
            raise httpx2.ReadTimeout(str(exc) or "timed out", request=request) from exc
        except OSError as exc:
            raise httpx2.ReadError(str(exc), request=request) from exc
        except httptools.HttpParserUpgrade as exc:
            raise httpx2.RemoteProtocolError("the server switched protocols", request=request) from exc
        except httptools.HttpParserError as exc:
            raise httpx2.RemoteProtocolError(f"malformed response: {exc}", request=request) from exc
        headers = httpx2.Headers(message.headers)
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        if request.method == "HEAD" or status in (204, 304):
            message.complete = True
        until_close = not (message.complete or chunked or "content-length" in headers)
        extensions: dict[str, Any] = {"http_version": b"HTTP/1.1", "reason_phrase": message.reason}
        return httpx2.Response(status, headers=headers,
                               stream=_Body(self, origin, sock, message, request,
                                            chunked, until_close),
                               extensions=extensions)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for kept in idle.values():
            for sock, _ in kept:
                sock.close()
