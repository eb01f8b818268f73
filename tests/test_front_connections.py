"""supervisor/connections.py over real sockets: new connections that have not
spoken are capped (the oldest are shed: their peer sees the end), one that
sent a request is kept, and the open-files limit always keeps RESERVE
descriptors out of the clients' reach (issue 29 item 3: at 1,024 descriptors, 1,100 idle TCP connections
locked the daemon)."""

from __future__ import annotations

import os
import resource
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from streamfence.supervisor import connections
from streamfence.supervisor.connections import FrontConnections
from tests.harness import wait_until


class Served:
    """A ROUTER as the daemon's client socket, watched by FrontConnections;
    `refused` records what ZAP is told."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.refused: list[bool] = []
        self.conns = FrontConnections(self.ctx, 0, self.refused.append)
        self.conns.watch(self.sock)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.raw: list[socket.socket] = []
        self.zmq_peers: list[zmq.Socket[Any]] = []

    def connect_raw(self, n: int) -> None:
        """`n` TCP connections that never say a word."""
        for _ in range(n):
            self.raw.append(socket.create_connection(("127.0.0.1", self.port)))

    def settle(self, predicate: Any, what: str) -> None:
        def turn() -> bool:
            self.conns.on_monitor()
            return bool(predicate())
        wait_until(turn, 30, what)

    def ended(self) -> list[bool]:
        """Which raw connections the server ended (what it sent is read and dropped)."""
        return [_ended(s) for s in self.raw]

    def close(self) -> None:
        for s in self.raw:
            s.close()
        for peer in self.zmq_peers:
            peer.close(linger=0)
        self.conns.close(self.sock)
        self.sock.close(linger=0)
        self.ctx.term()


def _ended(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        while s.recv(4096):
            pass
    except BlockingIOError:
        return False
    except OSError:
        pass
    return True


@pytest.fixture
def served() -> Iterator[Served]:
    s = Served()
    try:
        yield s
    finally:
        s.close()


def test_silent_connections_past_the_cap_are_shed_oldest_first(
        served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(connections, "SILENT_MAX", 200)  # the cap's rule, at a test's size
    spoken = served.ctx.socket(zmq.DEALER)  # the oldest, but it speaks: it stays
    spoken.linger = 0
    served.zmq_peers.append(spoken)
    spoken.connect(f"tcp://127.0.0.1:{served.port}")
    spoken.send(b"a request")
    assert served.sock.poll(10_000), "the request did not arrive"
    served.conns.on_monitor()  # its connection is counted before its request is read
    served.conns.spoke(served.sock.recv_multipart(copy=False)[-1])
    extra = 40
    served.connect_raw(connections.SILENT_MAX + extra)
    served.settle(lambda: served.conns.counts()["connections_shed"] >= extra,
                  f"{extra} idle connections to be shed")
    counts = served.conns.counts()
    assert counts["connections_silent"] <= connections.SILENT_MAX, counts
    wait_until(lambda: sum(served.ended()) >= extra, 30,
               "the shed connections' peers to see them end")
    assert all(served.ended()[:extra]), "the oldest go first"
    served.settle(lambda: served.conns.counts()["connections"] <= connections.SILENT_MAX + 1,
                  "the shed connections to be counted closed")
    assert served.refused[-1] is False  # no cap, room left: handshakes are not refused
    spoken.send(b"still here")
    assert served.sock.poll(10_000), "the connection that spoke was shed"


def test_the_descriptors_reserve_is_never_given_to_clients(served: Served) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = 30
    used = len(os.listdir("/proc/self/fd"))
    n = 60  # each costs this process two descriptors: the client's, the accepted one
    resource.setrlimit(resource.RLIMIT_NOFILE, (used + n + connections.RESERVE + room, hard))
    try:
        served.connect_raw(n)
        served.settle(lambda: served.conns.counts()["connections_shed"] >= n - room,
                      "the connections past the room to be shed")
        counts = served.conns.counts()
        assert counts["connections_silent"] <= room, counts
        assert served.refused[-1] is False, "handshakes in progress leave room for others"
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
