"""The sink's end of the worker wire: an AF_UNIX stream socket.

Each worker connects once and writes its T_DELTA and T_FINAL messages as
back-to-back msgpack arrays: msgpack is its own framing, so one `recv`
brings any number of messages and one unpacker (per connection, with the
limits of `codec.decode_untrusted`) splits them. Why not ZeroMQ here: at a
model's pace a ZeroMQ ipc message wakes the receiver's I/O thread and then
its loop (~130 us of CPU on this class of VM), and the sender's I/O thread
too; a stream socket wakes only the sink's loop (docs/PERFORMANCE.md).

Connections are read through one epoll, whose fd the sink's loop polls. The
only thing ever written back is a final's ack, on the connection it came on.
A connection whose bytes are not msgpack (nothing after them can be framed)
is closed and counted; its worker's attempt then ends without an accepted
final and is retried, as for any other worker fault.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
from collections.abc import Iterator

from streamfence.protocol.codec import untrusted_unpacker

READ_BYTES = 1 << 16  # per ready connection per turn: bounds one turn's work


class WorkerConn:
    """One worker's connection: its socket and the unpacker of its bytes."""

    __slots__ = ("sock", "unpacker")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.unpacker = untrusted_unpacker()

    def send(self, frame: bytes) -> bool:
        """Write an ack; False if it cannot be written now (the worker is gone
        or not reading: it waits for nothing else)."""
        try:
            return self.sock.send(frame) == len(frame)
        except OSError:
            return False


class WorkerStreams:
    """Owns the listening socket at `path`, the epoll and the connections."""

    def __init__(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(1024)
        self._listener.setblocking(False)
        self._epoll = select.epoll()
        self._epoll.register(self._listener.fileno(), select.EPOLLIN)
        self._conns: dict[int, WorkerConn] = {}

    def fileno(self) -> int:
        """The epoll's fd: readable when a worker connects or writes."""
        return self._epoll.fileno()

    def ready(self) -> Iterator[tuple[WorkerConn, bytes]]:
        """Each connection that had bytes, with up to READ_BYTES of them (a full
        read: it may have more). New connections are accepted; closed ones are
        dropped."""
        for fd, _ in self._epoll.poll(0):
            if fd == self._listener.fileno():
                self._accept()
                continue
            conn = self._conns.get(fd)
            if conn is None:
                continue
            try:
                data = conn.sock.recv(READ_BYTES)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                self.drop(conn)
                continue
            yield conn, data

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError:
                return  # EMFILE and the like: the worker retries its connect
            sock.setblocking(False)
            self._conns[sock.fileno()] = WorkerConn(sock)
            self._epoll.register(sock.fileno(), select.EPOLLIN)

    def drop(self, conn: WorkerConn) -> None:
        """Close a connection (its peer closed it, or sent what cannot be framed)."""
        fd = conn.sock.fileno()
        if self._conns.pop(fd, None) is None:
            return
        with contextlib.suppress(OSError, ValueError):
            self._epoll.unregister(fd)
        conn.sock.close()

    def close(self) -> None:
        for conn in list(self._conns.values()):
            self.drop(conn)
        self._epoll.close()
        self._listener.close()
