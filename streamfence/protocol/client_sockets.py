"""Watching and closing a client's sockets, the same for both shells.

The events socket has a monitor (its handshakes tell the client to listen
and resubscribe after a reconnect). libzmq's I/O thread sends monitor events
with a blocking send, and the monitored socket lives on after `close` until
its connections are torn down: an event in that time (a handshake finishing
just after the client closed) went to a monitor nobody read any more, and
the I/O thread waited on it forever, and with it every socket of the context
(every client of the program: no reply, no error). So the monitor is stopped
first, while the socket is still open (`disable_monitor`: no event after it).

The request socket has a monitor too until its first handshake
(`watch_link`, client_monitor.py). Nothing listening, libzmq reports a retry
every reconnect interval whether or not the client reads them; its receiving
end has no high-water mark (RCVHWM 0, set before it connects: an inproc
pipe's limit is the sum of both ends', none if either has none), so an idle
client never blocks the I/O thread on it; it holds what the client has not
read yet (~1 KB a second while nothing listens), read at its next wait.
"""

from __future__ import annotations

import contextlib
import struct
from typing import Any

import zmq

from streamfence.protocol.client_monitor import LINK_EVENTS

# Both shells' per-event looks and reads: plain ints and the compiled calls,
# since pyzmq's Python-level `getsockopt`, `recv_multipart` and enum members
# cost an enum operation or two per use, per event.
_EVENTS, _RCVMORE, _POLLIN = int(zmq.EVENTS), int(zmq.RCVMORE), int(zmq.POLLIN)
NOBLOCK = int(zmq.NOBLOCK)
_get, _recv = zmq.backend.Socket.get, zmq.backend.Socket.recv


def has_message(sock: zmq.Socket[bytes]) -> bool:
    """Whether `sock` holds a message to read now."""
    events: int = _get(sock, _EVENTS)  # type: ignore[assignment]
    return bool(events & _POLLIN)


def receive(sock: zmq.Socket[bytes]) -> list[bytes]:
    """One message of a socket that has one (`has_message` said so)."""
    frames = [_recv(sock, NOBLOCK)]
    while _get(sock, _RCVMORE):
        frames.append(_recv(sock, NOBLOCK))
    return frames


def watch_link(ctx: zmq.Context[Any], sock: zmq.Socket[Any], tag: str) -> zmq.Socket[bytes]:
    """The monitor of `sock`'s connection (LINK_EVENTS), made before it connects;
    `tag` makes its inproc address unique."""
    monitor: zmq.Socket[bytes] = ctx.socket(zmq.PAIR, socket_class=zmq.Socket)
    try:
        monitor.setsockopt(zmq.RCVHWM, 0)  # never block the I/O thread (module docstring)
        where = f"inproc://streamfence-link-{tag}"
        sock.monitor(where, LINK_EVENTS)
        monitor.connect(where)
    except BaseException:
        monitor.close(linger=0)
        raise
    return monitor


def link_events(monitor: zmq.Socket[Any]) -> list[tuple[int, int]]:
    """The (event, value) pairs the monitor holds, read without blocking."""
    out = []
    while monitor.poll(0):
        event, value = struct.unpack("=HI", monitor.recv_multipart()[0][:6])  # host order
        out.append((event, value))
    return out


def stop_watch(sock: zmq.Socket[Any], monitor: zmq.Socket[Any]) -> None:
    """Stop `sock`'s monitor, then close its receiving end (module docstring)."""
    with contextlib.suppress(zmq.ZMQError):
        sock.disable_monitor()
    monitor.close(linger=0)


def close_sockets(requests: zmq.Socket[Any], events: zmq.Socket[Any],
                  monitor: zmq.Socket[Any], link: zmq.Socket[Any] | None) -> None:
    """Close a client's request and events sockets, the events socket's monitor
    and the request socket's (`link`, if still watched); linger 0: unsent
    requests are dropped."""
    with contextlib.suppress(zmq.ZMQError):
        events.disable_monitor()
    if link is not None:
        stop_watch(requests, link)
    requests.close(linger=0)
    events.close(linger=0)
    monitor.close(linger=0)
