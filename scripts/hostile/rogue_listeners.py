"""Rogue listeners (issue 29, item 1): 300 events connections of one
non-admin identity, each subscribed from seq 0 to a finished 20,000-delta
call, none reading or acking; one of them subscribes again from seq 0 every
0.1 s. Before the fix this filled the sink's shared 256 MiB listener buffer
in 5-8 s and every other identity's calls took 70-80 s or lost events.

Now the identity holds at most its share of the buffer (`IDENTITY_BYTES`,
plus one frame per listener), at most `max_listeners` (64 by default) of
its connections get a subscription (the others are refused
`too_many_subscriptions`), and the probe's calls go on. Own checks: the
sink's unacknowledged bytes, sampled every 0.5 s, stay under that share's
bound; the cap refused the listeners past it; the sink really sent the
rogue's listeners a backlog (the attack happened).
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any

import msgpack
import zmq

from scripts.hostile import Attack, request
from streamfence.config.identities import DEFAULT_MAX_LISTENERS
from streamfence.protocol.client import Client
from streamfence.sink.subscribers import BATCH_BYTES, IDENTITY_BYTES

NAME = "rogue listeners"
ABOUT = "300 events connections of one identity, from seq 0 of a 20,000-delta call, none reading"

LISTENERS = 300
DELTAS = 20_000
SHARE_BOUND = IDENTITY_BYTES + DEFAULT_MAX_LISTENERS * BATCH_BYTES
_peak: dict[int, int] = {}  # id(attack) -> the most unacknowledged bytes the sink held


def _events_socket(ctx: zmq.Context[Any], a: Attack, creds: Any) -> tuple[str, zmq.Socket[Any]]:
    listener = f"rogue-{uuid.uuid4().hex}"
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.rcvhwm = 1  # it never reads: the backlog is the sink's
    sock.setsockopt(zmq.ROUTING_ID, listener.encode())
    creds.apply(sock)
    sock.connect(a.events_endpoint)
    sock.send(msgpack.packb({"v": 1, "op": "listen"}))
    return listener, sock


def _subscribe(req: zmq.Socket[Any], listener: str, call_id: str) -> None:
    req.send(msgpack.packb({"v": 1, "op": "subscribe", "ref": listener, "call_id": call_id,
                            "listener": listener, "from_seq": 0}))


def _replies(a: Attack, req: zmq.Socket[Any]) -> None:
    while True:
        try:
            reply = msgpack.unpackb(req.recv(zmq.NOBLOCK))
        except zmq.Again:
            return
        a.count(f"subscribes refused {reply.get('code')}")


def attack(a: Attack) -> None:
    creds = a.register("rogue")
    key = f"rogue-{uuid.uuid4().hex[:8]}"
    a.script(key, DELTAS)
    with Client(a.endpoint, 60.0, credentials=creds) as c:
        call_id = c.run("emu", request(key), timeout_s=120.0)["call_id"]
    a.count(f"a finished call of {DELTAS} deltas")
    ctx: zmq.Context[Any] = zmq.Context()
    socks: list[zmq.Socket[Any]] = []
    peak = _peak.setdefault(id(a), 0)
    try:
        req = ctx.socket(zmq.DEALER)
        req.linger = 0
        creds.apply(req)
        req.connect(a.endpoint)
        socks.append(req)
        listeners = []
        for _ in range(LISTENERS):
            if a.stop.is_set():
                return
            listener, sock = _events_socket(ctx, a, creds)
            socks.append(sock)
            listeners.append(listener)
            _subscribe(req, listener, call_id)
            a.count("events connections subscribed from seq 0 (never read)")
        with a.daemon.client() as admin:
            turn = 0
            while not a.stop.wait(0.1):
                _replies(a, req)
                _subscribe(req, a.rng.choice(listeners), call_id)
                a.count("subscribes again from seq 0")
                turn += 1
                if turn % 5 == 0:
                    with contextlib.suppress(TimeoutError):
                        held = int(admin.status()["sink"]["events_unacked_bytes"])
                        peak = _peak[id(a)] = max(peak, held)
        _replies(a, req)
    finally:
        for sock in socks:
            sock.close()
        ctx.term()


def checks(a: Attack) -> list[tuple[str, bool]]:
    peak = _peak.pop(id(a), 0)
    refused = a.counts.get("subscribes refused too_many_subscriptions", 0)
    return [
        (f"the sink held at most {peak / (1 << 20):.1f} MiB unacknowledged (the rogue's share "
         f"bound {SHARE_BOUND / (1 << 20):.0f} MiB; the buffer is 256 MiB)",
         0 < peak <= SHARE_BOUND),
        (f"subscribes past max_listeners ({DEFAULT_MAX_LISTENERS}) refused "
         f"too_many_subscriptions: {refused}", refused >= LISTENERS - DEFAULT_MAX_LISTENERS),
    ]
