"""A scripted HTTP/1.1 server on 127.0.0.1 for adapter and classifier tests
that need exact bytes the emulator does not script (odd SSE framing, gzip,
raw error bodies). Each POST gets the next Reply (the last one repeats)."""

from __future__ import annotations

import http.server
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson


@dataclass
class Reply:
    parts: list[bytes] = field(default_factory=list)
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    ctype: str = "text/event-stream"  # SSE replies are sent chunked, part by part
    end: str = "ok"  # ok | drop (close mid-body) | hang (until teardown)


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # client hang-ups are expected here
            super().handle_error(request, client_address)


class StubServer:
    def __init__(self) -> None:
        self.replies: list[Reply] = [Reply()]
        self.requests: list[Any] = []
        self.release = threading.Event()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                try:
                    owner.requests.append(orjson.loads(body))
                except orjson.JSONDecodeError:
                    owner.requests.append(body)
                reply = owner.replies.pop(0) if len(owner.replies) > 1 else owner.replies[0]
                self.send_response(reply.status)
                self.send_header("Content-Type", reply.ctype)
                for key, value in reply.headers.items():
                    self.send_header(key, value)
                if reply.ctype != "text/event-stream":
                    payload = b"".join(reply.parts)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    for part in reply.parts:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                        self.wfile.flush()
                    if reply.end == "hang":
                        owner.release.wait(30)
                    if reply.end == "ok":
                        self.wfile.write(b"0\r\n\r\n")
                    else:
                        self.close_connection = True
                except OSError:
                    self.close_connection = True

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)

    @property
    def reply(self) -> Reply:
        return self.replies[0]

    @reply.setter
    def reply(self, reply: Reply) -> None:
        """One reply for every request."""
        self.replies = [reply]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"


S = TypeVar("S", bound=StubServer)


@contextmanager
def stub_server(cls: type[S]) -> Iterator[S]:
    """A `cls` server, started; in teardown released, shut down and joined."""
    s = cls()
    s.thread.start()
    try:
        yield s
    finally:
        s.release.set()
        s.server.shutdown()
        s.server.server_close()  # joins the handler threads
        s.thread.join(5)
        assert not s.thread.is_alive()
