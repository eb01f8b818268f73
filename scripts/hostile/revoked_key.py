"""A revoked key's open events connection (issue 29, item 5): an identity
follows a long streaming call on raw sockets, reading and acking, and its
key is revoked (or rotated, every other round) mid-stream, again and again
with a new identity each round. Before the fix the connection received the
rest of the call (90 events in 4 s, then its done).

Own checks: each round's connection is told `key_revoked` within 1 s of
the key store's change, and receives no event after that notice.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgpack
import zmq

from scripts.hostile import Attack, request
from streamfence.protocol.credentials import Credentials
from streamfence.protocol.keys import KeyStore

NAME = "revoked key"
ABOUT = "a listener's key revoked or rotated mid-stream, a new identity each round"

NOTICE_BOUND_S = 1.0
AFTER_NOTICE_S = 0.5  # how long a cut connection is watched for more events
_rounds: dict[int, list[tuple[float | None, int]]] = {}  # id(attack) -> (notice after s, events after it)


def _events(frame: bytes) -> list[dict[str, Any]]:
    msg = msgpack.unpackb(frame)
    return msg if isinstance(msg, list) else [msg]


def _round(a: Attack, ctx: zmq.Context[Any], n: int) -> tuple[float | None, int]:
    """One identity, one long call, its key taken away mid-stream."""
    name = f"bob{n}"
    creds: Credentials = a.register(name)
    key = f"revoked-{uuid.uuid4().hex[:8]}"
    a.script(key, 400, delay_s=0.01)
    listener = f"revoked-{uuid.uuid4().hex}"
    req, events = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    events.setsockopt(zmq.ROUTING_ID, listener.encode())
    try:
        for sock, where in ((req, a.endpoint), (events, a.events_endpoint)):
            sock.linger = 0
            creds.apply(sock)
            sock.connect(where)
        events.send(msgpack.packb({"v": 1, "op": "listen"}))
        req.send(msgpack.packb({"v": 1, "op": "submit", "ref": "r", "listener": listener,
                                "call": {"provider": "emu", "request": request(key)}}))
        read, seen, changed, notice = 0, 0, 0.0, None
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            if not events.poll(100):
                continue
            frame = events.recv()
            read += len(frame)
            for event in _events(frame):
                if notice is not None and event.get("op") == "delta":
                    seen += 1  # an event after the notice: the cut did not hold
                elif event.get("op") == "error" and event.get("code") == "key_revoked":
                    notice = time.monotonic() - changed
                    deadline = time.monotonic() + AFTER_NOTICE_S
                elif event.get("op") == "delta" and not changed and event["seq"] >= 20:
                    keys = KeyStore(a.state_dir / "keys")
                    if n % 2:
                        keys.register(name, a.endpoint, replace=True)  # a rotation
                    else:
                        keys.revoke(name)
                    changed = time.monotonic()
            events.send(msgpack.packb({"v": 1, "op": "ack", "read": read}))
        a.count("keys rotated mid-stream" if n % 2 else "keys revoked mid-stream")
        return notice, seen
    finally:
        req.close()
        events.close()


def attack(a: Attack) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    rounds = _rounds.setdefault(id(a), [])
    try:
        n = 0
        while not a.stop.is_set():
            rounds.append(_round(a, ctx, n))
            n += 1
    finally:
        ctx.destroy(linger=0)


def checks(a: Attack) -> list[tuple[str, bool]]:
    rounds = _rounds.get(id(a), [])
    told = [t for t, _ in rounds if t is not None]
    after = sum(seen for _, seen in rounds)
    return [(f"each connection told key_revoked: {len(told)} of {len(rounds)}, slowest "
             f"{max(told, default=0) * 1000:.0f} ms after the key store changed (bound "
             f"{NOTICE_BOUND_S * 1000:.0f} ms)",
             bool(rounds) and len(told) == len(rounds) and max(told) <= NOTICE_BOUND_S),
            (f"events received after the notice: {after}", after == 0)]
