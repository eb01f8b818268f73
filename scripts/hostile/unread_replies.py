"""Issue 29 item 2: a client asks again and again for a finished call's large
result and never reads the replies. Past the reply budget
(supervisor/replies.py) they are refused with `reply_backlog`: the
supervisor's memory stays bounded and other clients are served."""

from __future__ import annotations

from typing import Any

import zmq

from scripts.hostile import Attack, request
from streamfence.protocol.client import Client
from streamfence.protocol.codec import encode

NAME = "unread replies"
ABOUT = "2,000 `result` requests for a call whose done is 0.88 MiB, never read"
ASKS = 2_000


def attack(a: Attack) -> None:
    creds = a.register("rogue-replies")
    a.script("bigdone", 50, text="x" * 900_000)
    with Client(a.endpoint, 60.0, credentials=creds) as client:
        call_id = client.submit("emu", request("bigdone"))
        for _ in client.events(call_id, timeout_s=60.0):
            pass
    ctx: zmq.Context[Any] = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.linger = 0
    rogue.rcvhwm = 1  # it reads nothing: what waits, waits in the daemon
    creds.apply(rogue)
    rogue.connect(a.endpoint)
    try:
        for n in range(ASKS):
            if a.stop.is_set():
                break
            rogue.send(encode({"v": 1, "op": "result", "ref": f"r{n}", "call_id": call_id}))
            a.count("result requests never read")
        a.stop.wait()
    finally:
        rogue.close(linger=0)
        ctx.term()


def checks(a: Attack) -> list[tuple[str, bool]]:
    with a.daemon.client() as admin:
        counters = admin.status()["counters"]
    return [("requests past the reply budget answered reply_backlog",
             counters.get("refused.reply_backlog", 0) > 0)]
