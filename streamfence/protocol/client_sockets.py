"""Closing a client's sockets, the same for both shells.

The events socket has a monitor (its handshakes tell the client to listen
and resubscribe after a reconnect). libzmq's I/O thread sends monitor events
with a blocking send, and the monitored socket lives on after `close` until
its connections are torn down: an event in that time (a handshake finishing
just after the client closed) went to a monitor nobody read any more, and
the I/O thread waited on it forever, and with it every socket of the context
(every client of the program: no reply, no error). So the monitor is stopped
first, while the socket is still open (`disable_monitor`: no event after it).
"""

from __future__ import annotations

import contextlib
from typing import Any

import zmq


def close_sockets(requests: zmq.Socket[Any], events: zmq.Socket[Any],
                  monitor: zmq.Socket[Any]) -> None:
    """Close a client's request and events sockets and the events socket's
    monitor (linger 0: unsent requests are dropped)."""
    with contextlib.suppress(zmq.ZMQError):
        events.disable_monitor()
    requests.close(linger=0)
    events.close(linger=0)
    monitor.close(linger=0)
