"""The client's end of a local events link (docs/PROTOCOL.md §5, sink/links.py).

A client whose daemon is on this host (an `ipc://` endpoint, or `tcp://` to
a loopback address) takes the sink's offer in `listening` (a path and a
one-use token): it connects to the path, sends `attach` with the token and
waits for `attached`, then reads its events there, in its own thread,
instead of through ZeroMQ's I/O thread. Both shells do this right after
routing the `listening`, so before any request names the listener: no
event can come on both paths. Anything that fails (no such path, a refused
token, no answer within ATTACH_TIMEOUT_S) leaves the client on the events
socket, as before. A link that ends (EOF) is a reconnect for the shell
(Router.handshake: listen again, resubscribe from the last seq).

The link carries msgpack maps and arrays back to back, the bytes the events
socket would carry in its frames, so they count in the acks the same way.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
from typing import Any

import msgpack

from streamfence.protocol.client_router import BAD_REPLY, ClientError, Router
from streamfence.protocol.codec import encode, untrusted_unpacker
from streamfence.protocol.messages import VERSION

log = logging.getLogger("streamfence.client")

ATTACH_TIMEOUT_S = 1.0  # the sink answers in its next loop turn (~ms)
READ_BYTES = 1 << 18
TOKEN_BYTES = 16


def is_local(endpoint: str) -> bool:
    """Whether the daemon at `endpoint` is on this host."""
    if endpoint.startswith("ipc://"):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class LocalEvents:
    """An attached link: its socket and the unpacker of what it brings."""

    def __init__(self, sock: socket.socket, max_frame: int) -> None:
        self._sock = sock
        self._unpacker = untrusted_unpacker(max_frame)

    @classmethod
    def attach(cls, offer: Any, max_frame: int) -> LocalEvents | None:
        """Take the sink's `offer`; None (and the events socket stays) if it
        cannot be taken."""
        if not (isinstance(offer, dict) and isinstance(offer.get("path"), str)
                and isinstance(offer.get("token"), bytes)
                and len(offer["token"]) == TOKEN_BYTES):
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(ATTACH_TIMEOUT_S)
            sock.connect(offer["path"])
            sock.sendall(encode({"v": VERSION, "op": "attach", "token": offer["token"]}))
            unpacker = untrusted_unpacker(max_frame)
            answer: Any = None
            while answer is None:
                data = sock.recv(READ_BYTES)
                if not data:
                    raise ConnectionError("the sink closed the link: the token was refused")
                unpacker.feed(data)
                answer = next(unpacker, None)
            if answer != {"v": VERSION, "op": "attached"}:
                raise ConnectionError(f"the sink answered {answer!r}")
        except (OSError, ValueError, msgpack.UnpackException) as exc:
            log.debug("no local events link (%s): events come on the events socket", exc)
            sock.close()
            return None
        sock.setblocking(False)
        link = cls(sock, max_frame)
        link._unpacker = unpacker  # what came with the answer is routed first
        return link

    def fileno(self) -> int:
        return self._sock.fileno()

    def read(self, router: Router) -> bool:
        """Route what the link holds (counted for the acks); False once it ended."""
        try:
            data = self._sock.recv(READ_BYTES)
        except BlockingIOError:
            data = None
        except OSError:
            data = b""
        if data == b"":
            return False
        try:
            if data:
                router.read += len(data)
                self._unpacker.feed(data)
            for msg in self._unpacker:
                router.route_message(msg)
        except (ValueError, msgpack.UnpackException) as exc:  # not a stream of messages
            raise ClientError(BAD_REPLY, f"the daemon sent undecodable bytes: {exc}") from None
        return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
