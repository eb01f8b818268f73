"""A worker's end of the worker wire: one AF_UNIX stream connection to the
sink (sink/streams.py), carrying msgpack arrays back to back.

Sends never block the worker: what the socket does not take at once waits,
in order, in a backlog that goes out before the next message, so the worker
keeps reading its provider whatever the sink does (the liveness of the
stream is the provider's, never the sink's). The backlog also holds what is
sent before the sink first listens: the next send or the wait for a final's
ack connects. A connection that breaks (the sink died) takes its backlog
with it, since a message cut in the middle cannot open a new connection, and
sets `lost`: the worker then asks the restarted sink where to go on
(T_HELLO, answered by T_REBIND; workers/worker.py `SinkOutput`,
ARCHITECTURE §2.8).
"""

from __future__ import annotations

import contextlib
import select
import socket
import time
from typing import Any

from streamfence.protocol.codec import untrusted_unpacker

RECONNECT_EVERY_S = 0.01  # while waiting for an ack with the sink away
LOST = object()  # `wait_reply`: the connection broke while waiting


class SinkChannel:
    """Owns the connection, its backlog and the unpacker of the sink's replies."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._sock: socket.socket | None = None
        self._backlog = bytearray()
        self._replies = untrusted_unpacker()
        self.lost = False  # a connection broke (the sink went away) since the worker last looked

    def _connect(self) -> bool:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            return False
        sock.setblocking(False)
        self._sock = sock
        self._replies = untrusted_unpacker()
        return True

    def _broken(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self._backlog.clear()
            self.lost = True

    def _flush(self) -> None:
        """Write as much of the backlog as the socket takes now."""
        if self._sock is None and not self._connect():
            return
        assert self._sock is not None
        while self._backlog:
            try:
                n = self._sock.send(self._backlog)
            except BlockingIOError:
                return
            except OSError:  # the sink went away: its successor gets the rest
                self._broken()
                return
            del self._backlog[:n]

    def send(self, frame: bytes) -> None:
        """Write one message (a packed msgpack array); what the socket does not
        take now is queued behind the backlog."""
        sock = self._sock
        if sock is None or self._backlog:
            self._backlog += frame
            self._flush()
            return
        try:
            n = sock.send(frame)  # the per-delta path: one syscall, no copy
        except BlockingIOError:
            n = 0
        except OSError:
            self._broken()
            return
        if n < len(frame):
            self._backlog += frame[n:]

    def wait_reply(self, timeout_s: float) -> Any | None:
        """The sink's next reply, once everything queued is written; None if
        none came within `timeout_s`, LOST if the connection broke first."""
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(StopIteration):
                return next(self._replies)
            if self.lost:
                return LOST
            self._flush()
            if self.lost:
                return LOST
            left = deadline - time.monotonic()
            if self._sock is None:
                if left <= 0:
                    return None
                time.sleep(min(left, RECONNECT_EVERY_S))
                continue
            writing = [self._sock] if self._backlog else []
            readable, _, _ = select.select([self._sock], writing, [], max(0.0, left))
            if readable:
                try:
                    data = self._sock.recv(1 << 16)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    self._broken()
                    continue
                self._replies.feed(data)
            elif left <= 0:
                return None

    def close(self) -> None:
        self._broken()
