"""Plain links: a listener's events over a Unix stream socket of this host.

At a model's pace a frame on the ZeroMQ events socket puts two threads on a
CPU that only carry it: the sink's ZeroMQ I/O thread and the client's
(docs/PERFORMANCE.md, "Issue 32: a plain events link"). A client on this
host can take its events over a stream socket in the daemon's runtime
directory instead, written by the sink's loop and read by the client's own
thread. Listens and acks stay on the events socket.

- Who: `offer(listener)` makes a one-use token (16 random bytes), handed out
  in `listening`, so over the events socket and its CURVE. A connection's
  first message must be `{"v": 1, "op": "attach", "token": T}` with the
  token last offered to a listener, within TOKEN_TTL_S; it is answered
  `attached`, and the listener's frames go there from then on (a newer
  link of the listener replaces the older, which is closed). A connection
  that sends anything else, or nothing within ATTACH_WITHIN_S, is closed
  and counted (`refused`); past PENDING_MAX unattached connections a new
  one is closed at once.
- Frames: msgpack maps and arrays back to back, the bytes the events socket
  would carry (msgpack is its own framing, as on the worker wire); the
  client counts them in its acks as it counts the socket's.
- Writes never block: what the kernel does not take waits in the link's
  buffer, written when the link is writable, as frames wait in a ZeroMQ
  queue. The buffer holds only bytes the listener has not acknowledged, so
  the listener's window bounds it (sink/subscribers.py).
- Ends: the client closes it, or sends anything after its attach; the
  sink closes it (`close_link`: a revoked key). The listener is then not
  connected until it attaches again; `poll` names it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import socket
import time
from collections.abc import Callable

from streamfence.protocol.codec import encode, untrusted_unpacker
from streamfence.protocol.messages import VERSION

TOKEN_BYTES = 16
TOKEN_TTL_S = 10.0  # an offer not taken by then is void (the client listens again)
ATTACH_WITHIN_S = 1.0  # a connection's attach must come within this
PENDING_MAX = 64  # unattached connections at once; past it a new one is closed
ATTACH_MAX_BYTES = 256  # an attach message is ~40 bytes
_ATTACHED = encode({"v": VERSION, "op": "attached"})
_IN, _OUT = select.EPOLLIN, select.EPOLLIN | select.EPOLLOUT
_GONE = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR  # on a link: it ended


class Link:
    """One attached connection: its socket and what the kernel has not taken yet."""

    __slots__ = ("listener", "out", "sock")

    def __init__(self, sock: socket.socket, listener: bytes) -> None:
        self.sock = sock
        self.listener = listener
        self.out = bytearray()


class Links:
    """Owns the listening socket at `path`, its epoll, the offers and the links."""

    def __init__(self, path: str, clock: Callable[[], float] = time.monotonic) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self.path = path
        self._clock = clock
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(path)
        self._server.listen(128)
        self._server.setblocking(False)
        self._epoll = select.epoll()
        self._epoll.register(self._server.fileno(), select.EPOLLIN)
        self._offers: dict[bytes, tuple[bytes, float]] = {}  # token -> (listener, until)
        self._offer_of: dict[bytes, bytes] = {}  # listener -> its last token
        self._pending: dict[int, tuple[socket.socket, float]] = {}  # fd -> (sock, since)
        self._by_fd: dict[int, Link] = {}
        self._links: dict[bytes, Link] = {}  # listener -> its link
        self.refused = 0
        self.attached = 0
        self.bytes_sent = 0  # handed to the links (written, or waiting in a buffer)

    def fileno(self) -> int:
        """The epoll's fd: readable when a client connects, writes, or a link drains."""
        return self._epoll.fileno()

    def get(self, listener: bytes) -> Link | None:
        return self._links.get(listener)

    def offer(self, listener: bytes) -> bytes:
        """A fresh token for `listener` (its earlier one is void)."""
        old = self._offer_of.pop(listener, None)
        if old is not None:
            self._offers.pop(old, None)
        token = secrets.token_bytes(TOKEN_BYTES)
        self._offers[token] = (listener, self._clock() + TOKEN_TTL_S)
        self._offer_of[listener] = token
        return token

    def write(self, link: Link, frame: bytes) -> bool:
        """Send `frame` on `link` (what the kernel does not take waits in its
        buffer); False if the link is gone (closed here: the caller releases
        the listener's bytes)."""
        self.bytes_sent += len(frame)
        if link.out:
            link.out += frame
            return True
        try:
            sent = link.sock.send(frame)
        except BlockingIOError:
            sent = 0
        except OSError:
            self.close_link(link.listener)
            return False
        if sent < len(frame):
            link.out += memoryview(frame)[sent:]
            self._epoll.modify(link.sock.fileno(), _OUT)
        return True

    def send(self, listener: bytes, frame: bytes) -> bool | None:
        """`frame` to the listener's link: None if it has none, False if the
        link is gone (closed here), True if written or waiting in its buffer."""
        link = self._links.get(listener)
        return None if link is None else self.write(link, frame)

    def poll(self) -> list[bytes]:
        """Accept, read attaches, flush buffers; the listeners whose links ended."""
        ended: list[bytes] = []
        for fd, events in self._epoll.poll(0):
            if fd == self._server.fileno():
                self._accept()
            elif fd in self._pending:
                self._attach(fd)
            elif (link := self._by_fd.get(fd)) is not None and (
                    events & _GONE or (events & select.EPOLLOUT and not self._flush(link))):
                # EOF, or bytes a client never sends after its attach.
                self.close_link(link.listener)
                ended.append(link.listener)
        return ended

    def tick(self) -> None:
        """Close the connections that did not attach in time; forget old offers."""
        now = self._clock()
        for fd, (sock, since) in list(self._pending.items()):
            if now - since >= ATTACH_WITHIN_S:
                self._refuse(fd, sock)
        for token, (listener, until) in list(self._offers.items()):
            if now >= until:
                del self._offers[token]
                if self._offer_of.get(listener) == token:
                    del self._offer_of[listener]

    def due(self) -> float | None:
        """When `tick` has something to close (monotonic s), or None."""
        if not self._pending:
            return None
        return min(since for _, since in self._pending.values()) + ATTACH_WITHIN_S

    def close_link(self, listener: bytes) -> None:
        link = self._links.pop(listener, None)
        if link is None:
            return
        fd = link.sock.fileno()
        self._by_fd.pop(fd, None)
        with contextlib.suppress(OSError, ValueError):
            self._epoll.unregister(fd)
        link.sock.close()

    def close(self) -> None:
        for listener in list(self._links):
            self.close_link(listener)
        for fd, (sock, _) in list(self._pending.items()):
            self._pending.pop(fd)
            sock.close()
        self._epoll.close()
        self._server.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    # ---- connections ----------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._server.accept()
            except (BlockingIOError, OSError):
                return  # EMFILE and the like: the client falls back to the events socket
            if len(self._pending) >= PENDING_MAX:
                self.refused += 1
                sock.close()
                continue
            sock.setblocking(False)
            self._pending[sock.fileno()] = (sock, self._clock())
            self._epoll.register(sock.fileno(), select.EPOLLIN)

    def _attach(self, fd: int) -> None:
        """The first message of a pending connection: a valid attach, or it is closed."""
        sock, _ = self._pending[fd]
        try:
            data = sock.recv(ATTACH_MAX_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        token = _attach_token(data)
        offer = self._offers.pop(token, None) if token is not None else None
        if offer is None or self._clock() >= offer[1]:
            self._refuse(fd, sock)
            return
        listener = offer[0]
        self._offer_of.pop(listener, None)
        del self._pending[fd]
        self.close_link(listener)  # a newer link replaces the older
        link = Link(sock, listener)
        self._links[listener] = link
        self._by_fd[fd] = link
        self.attached += 1
        self.write(link, _ATTACHED)

    def _refuse(self, fd: int, sock: socket.socket) -> None:
        self.refused += 1
        self._pending.pop(fd, None)
        with contextlib.suppress(OSError, ValueError):
            self._epoll.unregister(fd)
        sock.close()

    def _flush(self, link: Link) -> bool:
        """Write what waits in the link's buffer; False if the link is gone."""
        try:
            sent = link.sock.send(link.out)
        except BlockingIOError:
            return True
        except OSError:
            return False
        del link.out[:sent]
        if not link.out:
            self._epoll.modify(link.sock.fileno(), _IN)
        return True


def _attach_token(data: bytes) -> bytes | None:
    """The token of an attach message that is exactly `data`, or None."""
    unpacker = untrusted_unpacker(ATTACH_MAX_BYTES)
    unpacker.feed(data)
    try:
        msg = next(unpacker)
    except Exception:  # not one msgpack message: garbage of any kind
        return None
    if unpacker.tell() != len(data) or not isinstance(msg, dict) \
            or msg.get("v") != VERSION or msg.get("op") != "attach":
        return None
    token = msg.get("token")
    return token if isinstance(token, bytes) and len(token) == TOKEN_BYTES else None
