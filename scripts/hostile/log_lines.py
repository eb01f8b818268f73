"""What a client can do to the daemon's log (issue 29, item 8): forge lines
with a newline in the fields it chooses (`session_id`, `model`), and fill
it with CURVE handshakes under keys nobody registered (before the fix: one
WARNING per handshake, 648 lines for 648).

Own checks: no line of the daemon's text log begins with the forged text;
the refused handshakes wrote at most one line per 10 s (and at least one).
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import replace
from typing import Any

import zmq

from scripts.hostile import Attack
from streamfence.protocol.client import Client

NAME = "log lines"
ABOUT = "newlines in session_id and model; CURVE handshakes with unregistered keys"
DAEMON = {"log_level": "INFO"}  # the lines that carry a call's session and model

FORGED = "FORGED-by-a-client"
_started: dict[int, float] = {}


def _handshakes(a: Attack, ctx: zmq.Context[Any], creds: Any) -> None:
    """Ten connections under fresh unregistered keys, each saying status."""
    socks = []
    for _ in range(10):
        public, secret = zmq.curve_keypair()
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        replace(creds, public_key=public, secret_key=secret).apply(sock)
        sock.connect(a.endpoint)
        sock.send(b"\x81\xa2op\xa6status")
        socks.append(sock)
    time.sleep(0.1)  # the handshakes happen
    for sock in socks:
        sock.close()
    a.count("handshakes with unregistered keys", len(socks))


def attack(a: Attack) -> None:
    _started[id(a)] = time.monotonic()
    creds = a.register("forger")
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        with Client(a.endpoint, 10.0, credentials=creds) as c:
            while not a.stop.is_set():
                key = f"forge-{uuid.uuid4().hex[:8]}\n{FORGED} model"
                a.script(key, 3)
                c.run("emu", {"model": f"gpt-emu#{key}",
                              "messages": [{"role": "user", "content": "hi"}]},
                      session_id=f"s\n{FORGED} session", timeout_s=10.0)
                a.count("calls with a newline in session_id and model")
                _handshakes(a, ctx, creds)
    finally:
        ctx.destroy(linger=0)


def checks(a: Attack) -> list[tuple[str, bool]]:
    lines = a.daemon.log_text().splitlines()
    forged = [ln for ln in lines if ln.startswith(FORGED)]
    carried = sum(FORGED in ln for ln in lines)
    refused = [ln for ln in lines if "CURVE handshake(s) with an unregistered key" in ln]
    took = time.monotonic() - _started.get(id(a), time.monotonic())
    bound = math.ceil(took / 10.0) + 1
    return [(f"log lines that begin with the forged text: {len(forged)} (lines that carry it "
             f"escaped: {carried})", not forged and carried > 0),
            (f"refused-handshake warnings: {len(refused)} over {took:.0f} s (bound {bound})",
             0 < len(refused) <= bound)]
