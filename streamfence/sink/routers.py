"""The sink's ROUTER sockets (`sink.in`, `sink.ctl`): how they are made, how
one frame is sent to one peer, and how the rest of a multi-part message
(never valid on them: every message is one frame) is dropped."""

from __future__ import annotations

from typing import Any

import zmq

from streamfence.protocol.codec import DEFAULT_MAX_FRAME


def router(ctx: zmq.Context[Any], endpoint: str) -> zmq.Socket[bytes]:
    s: zmq.Socket[bytes] = ctx.socket(zmq.ROUTER)
    # Mandatory: an unknown peer is an error we see, not a silent drop.
    # No send HWM: the supervisor is our own process and must get every
    # event (with HWM+mandatory a send could block the loop instead).
    s.setsockopt(zmq.ROUTER_MANDATORY, 1)
    s.setsockopt(zmq.SNDHWM, 0)
    s.setsockopt(zmq.RCVHWM, 10_000)
    s.setsockopt(zmq.MAXMSGSIZE, DEFAULT_MAX_FRAME)
    s.setsockopt(zmq.LINGER, 500)
    s.bind(endpoint)
    return s


def send(sock: zmq.Socket[bytes], ident: bytes, frame: bytes) -> bool:
    """One frame to the peer `ident`; False if it is gone (EHOSTUNREACH): nobody to answer."""
    try:
        sock.send(ident, zmq.SNDMORE | zmq.NOBLOCK)
        sock.send(frame, zmq.NOBLOCK)
        return True
    except zmq.ZMQError:
        return False


def resync(sock: zmq.Socket[bytes]) -> bool:
    """Drop the rest of a multi-part message; True if there was any."""
    if not sock.getsockopt(zmq.RCVMORE):
        return False
    while sock.getsockopt(zmq.RCVMORE):
        sock.recv()
    return True
