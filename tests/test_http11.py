"""The workers' HTTP/1.1 transport (workers/http11.py) against real servers
on 127.0.0.1 that write exact bytes: a streamed body arrives read by read,
kept connections are reused and a closed one is not, every way a response
can end (length, chunked, the connection's close, a cut) ends as HTTP says,
failures raise the httpx2 exceptions the error classifier knows, and the
openai SDK runs a worker's attempt over it through TLS."""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx2
import openai
import orjson
import pytest

from streamfence.devtools.certs import self_signed
from streamfence.workers.errors import classify
from streamfence.workers.http11 import Http11Transport
from streamfence.workers.openai_chat import stream_chat
from streamfence.workers.output import RecordingOutput

WAIT_S = 10.0
HI = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}  # a worker's request

Handler = Callable[[socket.socket, bytes], None]


def read_request(conn: socket.socket) -> bytes:
    """One whole request (head and Content-Length body); b"" at EOF."""
    data = b""
    while b"\r\n\r\n" not in data:
        more = conn.recv(65536)
        if not more:
            return b""
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        body += conn.recv(65536)
    return head


class RawServer:
    """Accepts connections on 127.0.0.1; each connection's requests go, one
    after the other, to `handler(conn, request_head)`, which writes the answer
    and returns False to close the connection."""

    def __init__(self, handler: Callable[[socket.socket, bytes], bool],
                 tls: ssl.SSLContext | None = None) -> None:
        self.handler, self.tls = handler, tls
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        self.requests: list[bytes] = []
        self._threads: list[threading.Thread] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
            while True:
                head = read_request(conn)
                if not head:
                    return
                self.requests.append(head)
                if not self.handler(conn, head):
                    return
        except OSError:
            return
        finally:
            conn.close()

    def url(self, path: str = "/v1/x") -> str:
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://127.0.0.1:{self.port}{path}"

    def close(self) -> None:
        self.listener.close()
        for t in self._threads:
            t.join(WAIT_S)


@pytest.fixture
def serve() -> Iterator[Callable[..., RawServer]]:
    servers: list[RawServer] = []

    def start(handler: Callable[[socket.socket, bytes], bool],
              tls: ssl.SSLContext | None = None) -> RawServer:
        server = RawServer(handler, tls)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


@pytest.fixture
def client() -> Iterator[httpx2.Client]:
    with httpx2.Client(transport=Http11Transport(ssl.create_default_context()),
                       timeout=WAIT_S) as c:
        yield c


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def ok_with_length(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


def answer_then_hold(answer: bytes, release: threading.Event
                     ) -> Callable[[socket.socket, bytes], bool]:
    """A handler that writes `answer`, then holds the connection open until `release`."""
    def handler(conn: socket.socket, head: bytes) -> bool:
        conn.sendall(answer)
        release.wait(WAIT_S)
        return False
    return handler


def test_a_streamed_body_arrives_read_by_read(serve: Callable[..., RawServer],
                                              client: httpx2.Client) -> None:
    # The server writes its second chunk only once the client has the first:
    # a transport that waited for more than one read would never see it.
    got_first = threading.Event()

    def handler(conn: socket.socket, head: bytes) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk(b"one"))
        assert got_first.wait(WAIT_S), "the client never read the first chunk"
        conn.sendall(chunk(b"two") + b"0\r\n\r\n")
        return True

    server = serve(handler)
    with client.stream("POST", server.url(), content=b"{}") as response:
        pieces = []
        for piece in response.iter_raw():
            pieces.append(piece)
            got_first.set()
    assert response.status_code == 200 and response.http_version == "HTTP/1.1"
    assert pieces == [b"one", b"two"]
    assert server.requests[0].startswith(b"POST /v1/x HTTP/1.1\r\n")


def test_a_kept_connection_carries_the_next_request(serve: Callable[..., RawServer],
                                                    client: httpx2.Client) -> None:
    def handler(conn: socket.socket, head: bytes) -> bool:
        conn.sendall(ok_with_length(b"hello"))
        return True

    server = serve(handler)
    assert [client.post(server.url(), content=b"{}").content for _ in range(3)] == [b"hello"] * 3
    assert server.connections == 1


def test_a_connection_the_server_closed_is_not_reused(serve: Callable[..., RawServer],
                                                      client: httpx2.Client) -> None:
    # The server answers as if it kept the connection, then closes it: the
    # next request must go out on a new one, not fail on the dead one.
    closed = threading.Event()

    def handler(conn: socket.socket, head: bytes) -> bool:
        conn.sendall(ok_with_length(b"hi"))
        # Closed before the test goes on (a loopback FIN is delivered within
        # close()): a request sent before it would race the close, as with
        # any HTTP client, and that race is not what this test asks about.
        conn.close()
        closed.set()
        return False

    server = serve(handler)
    assert client.post(server.url(), content=b"{}").content == b"hi"
    assert closed.wait(WAIT_S)
    assert client.post(server.url(), content=b"{}").content == b"hi"
    assert server.connections == 2


def test_a_connection_the_server_asked_to_close_is_not_reused(
        serve: Callable[..., RawServer], client: httpx2.Client) -> None:
    # "Connection: close", and the server holds the socket open a while: a
    # transport that kept it would send the next request where nobody reads.
    release = threading.Event()
    server = serve(answer_then_hold(
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nhi", release))
    try:
        for _ in range(2):
            assert client.post(server.url(), content=b"{}", timeout=2.0).content == b"hi"
    finally:
        release.set()
    assert server.connections == 2


def test_a_body_without_length_ends_with_the_connection(serve: Callable[..., RawServer],
                                                        client: httpx2.Client) -> None:
    def handler(conn: socket.socket, head: bytes) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")
        return False

    server = serve(handler)
    assert client.post(server.url(), content=b"{}").content == b"until the end"
    assert client.post(server.url(), content=b"{}").content == b"until the end"
    assert server.connections == 2


def test_an_interim_response_is_skipped(serve: Callable[..., RawServer],
                                        client: httpx2.Client) -> None:
    def handler(conn: socket.socket, head: bytes) -> bool:
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n" + ok_with_length(b"final"))
        return True

    server = serve(handler)
    response = client.post(server.url(), content=b"{}")
    assert (response.status_code, response.content) == (200, b"final")


def test_a_body_cut_mid_chunk_is_a_transient_connection_error(
        serve: Callable[..., RawServer], client: httpx2.Client) -> None:
    def handler(conn: socket.socket, head: bytes) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + chunk(b"part") + b"10\r\nonly half")
        return False

    server = serve(handler)
    with (client.stream("POST", server.url(), content=b"{}") as response,
          pytest.raises(httpx2.RemoteProtocolError) as info):
        list(response.iter_raw())
    assert "incomplete chunked read" in str(info.value)
    error = classify(info.value)
    assert (error.error_class.value, error.code) == ("transient", "connection_error")


@pytest.mark.parametrize("answer, expected", [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "incomplete body"),
    (b"SPDY/9 what\r\n\r\n", "malformed response"),
    (b"", "without sending a response"),
])
def test_a_broken_answer_raises_remote_protocol_error(
        serve: Callable[..., RawServer], client: httpx2.Client, answer: bytes,
        expected: str) -> None:
    def handler(conn: socket.socket, head: bytes) -> bool:
        conn.sendall(answer)
        return False

    server = serve(handler)
    with pytest.raises(httpx2.RemoteProtocolError, match=expected):
        client.post(server.url(), content=b"{}")


def test_a_silent_server_is_a_read_timeout(serve: Callable[..., RawServer]) -> None:
    release = threading.Event()
    server = serve(answer_then_hold(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                                    release))
    with (httpx2.Client(transport=Http11Transport(ssl.create_default_context())) as c,
          c.stream("POST", server.url(), content=b"{}",
                   timeout=httpx2.Timeout(WAIT_S, read=0.2)) as response,
          pytest.raises(httpx2.ReadTimeout)):
        list(response.iter_raw())
    release.set()
    assert classify(httpx2.ReadTimeout("timed out")).code == "read_timeout"


def test_a_refused_connection_is_a_connect_error(client: httpx2.Client) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(httpx2.ConnectError) as info:
        client.post(f"http://127.0.0.1:{port}/v1/x", content=b"{}")
    assert classify(info.value).code == "connect_error"


def test_a_line_break_in_a_header_is_never_sent(serve: Callable[..., RawServer],
                                                client: httpx2.Client) -> None:
    server = serve(lambda conn, head: False)
    with pytest.raises(httpx2.LocalProtocolError):
        client.post(server.url(), content=b"{}", headers={"X-Evil": "a\r\nX-Injected: 1"})
    assert server.requests == []


# ---- TLS, with the openai SDK running a worker's attempt --------------------------

@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("tls")
    self_signed(where)
    return where


def sse_writes() -> list[bytes]:
    """An openai stream's writes, its body's end (the chunked terminator) left out."""
    writes = [b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n"]
    for text in ("Hel", "lo"):
        piece = {"id": "c1", "object": "chat.completion.chunk", "model": "m",
                 "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
        writes.append(chunk(b"data: " + orjson.dumps(piece) + b"\n\n"))
    done = ('data: {"id":"c1","object":"chat.completion.chunk","model":"m","choices":'
            '[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n')
    writes.append(chunk(done.encode()))
    return writes


def sse_answer(conn: socket.socket, head: bytes) -> bool:
    *writes, last = sse_writes()
    for data in writes:
        conn.sendall(data)
    conn.sendall(last + b"0\r\n\r\n")
    return True


def sse_answer_end_apart(conn: socket.socket, head: bytes) -> bool:
    """`sse_answer` with the body's end in a TLS record of its own after
    `[DONE]`'s, as a provider's front may write it; corked, so that it has
    arrived, unread, when the SDK closes the stream at `[DONE]`."""
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)
    for data in sse_writes():
        conn.sendall(data)
    conn.sendall(b"0\r\n\r\n")
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 0)
    return True


def _attempts_over_tls(serve: Callable[..., RawServer], certificate: Path,
                       answer: Callable[[socket.socket, bytes], bool], attempts: int) -> RawServer:
    """`attempts` worker attempts of the openai SDK, one after the other, on a
    TLS server that answers with `answer`, each asserted to stream "Hello"."""
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(certificate / "cert.pem", certificate / "key.pem")
    server = serve(answer, tls=server_tls)
    trusting = ssl.create_default_context(cafile=str(certificate / "cert.pem"))
    with openai.OpenAI(base_url=server.url("/v1"), api_key="sk-test", max_retries=0, timeout=WAIT_S,
                       http_client=httpx2.Client(transport=Http11Transport(trusting))) as sdk:
        for _ in range(attempts):
            out = RecordingOutput()
            outcome = stream_chat(sdk, HI, out)
            assert outcome.error is None and out.text == "Hello", outcome.error
    return server


def test_a_tls_stream_whose_end_comes_apart_keeps_its_connection(
        serve: Callable[..., RawServer], certificate: Path) -> None:
    """The openai SDK closes the stream at `[DONE]`; the transport reads the
    body's end that has already arrived and keeps the connection, so the next
    attempt costs no new TLS handshake (red without it: three connections)."""
    server = _attempts_over_tls(serve, certificate, sse_answer_end_apart, 3)
    assert server.connections == 1
    assert len(server.requests) == 3


def test_the_openai_sdk_streams_a_worker_attempt_over_tls(
        serve: Callable[..., RawServer], certificate: Path) -> None:
    # Two attempts: the second on the kept TLS connection.
    server = _attempts_over_tls(serve, certificate, sse_answer, 2)
    assert server.connections == 1
    assert server.requests[0].startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")

    # A certificate the client does not trust: the handshake fails, and the
    # classifier still finds why (a final error: retrying cannot help).
    untrusting = Http11Transport(ssl.create_default_context())
    with openai.OpenAI(base_url=server.url("/v1"), api_key="sk-test", max_retries=0, timeout=WAIT_S,
                       http_client=httpx2.Client(transport=untrusting)) as sdk:
        out = RecordingOutput()
        outcome = stream_chat(sdk, HI, out)
    assert outcome.error is not None and outcome.error.code == "tls_verify_failed", outcome.error
