"""Chaos: malformed, oversized, truncated and forged frames on the front
socket, the events socket and the sink's internal sockets, while a load of
real calls runs.

    python -m scripts.chaos_input [--seed N] [--calls 2000] [--duration 60]

Forged deltas carry live call ids with stale, future or random attempt
numbers, and garbage seqs; forged finals and control messages too. None may
be accepted (the verdict would show interleaved / superseded), every real
call must end as usual, and the daemon must still answer at the end.
"""

from __future__ import annotations

import os
import random
import sys
import threading
from typing import Any

import msgpack
import zmq

from scripts.chaos_common import ChaosState, chaos_run, parser, run_load, seeded, verdict
from streamfence.protocol.codec import encode
from streamfence.protocol.credentials import load_credentials
from streamfence.protocol.internal import (
    C_AUTHORIZE,
    C_FENCE,
    C_FINISH,
    T_DELTA,
    T_FINAL,
    Endpoints,
)
from streamfence.protocol.messages import events_endpoint


def steps(rng: random.Random) -> list[dict[str, Any]]:
    return [{"fault": "ok", "chunks": rng.randint(10, 40),
             "chunk_delay_s": rng.uniform(0.005, 0.02)}] * 4


def options(rng: random.Random) -> dict[str, Any]:
    return {}


def _garbage(rng: random.Random) -> list[bytes]:
    kind = rng.randrange(8)
    if kind == 0:
        return [os.urandom(rng.randint(0, 64))]
    if kind == 1:
        return [msgpack.packb({"v": 1, "op": "submit", "ref": "x"})[:-1]]  # truncated
    if kind == 2:
        return [b"\x00" * rng.randint(1, 3 * 1024 * 1024)]  # oversized for the test limit
    if kind == 3:
        return [msgpack.packb({"v": 1}), b"second frame"]
    if kind == 4:
        return [msgpack.packb(msgpack.ExtType(5, b"pickle?"))]
    if kind == 5:
        return [msgpack.packb({"v": rng.randint(2, 9), "op": "status", "ref": "x"})]
    if kind == 6:
        return [msgpack.packb({"v": 1, "op": "submit", "ref": "x",
                               "call": {"provider": "emu", "request": [1, 2]}})]
    return [msgpack.packb([rng.random(), None, {"a": [1] * rng.randint(0, 50)}])]


def _forged(rng: random.Random, live: list[dict[str, Any]]) -> bytes:
    call: dict[str, Any] = (rng.choice(live) if live and rng.random() < 0.8
                            else {"call_id": os.urandom(8).hex(), "attempt": 1})
    attempt = rng.choice([call["attempt"] - 1, call["attempt"] + rng.randint(1, 5),
                          rng.randint(-5, 1000), 0])
    kind = rng.randrange(4)
    if kind == 0:
        return encode([T_DELTA, call["call_id"], attempt, rng.randint(-3, 500), "text", "FORGED"])
    if kind == 1:
        return encode([T_FINAL, call["call_id"], attempt, rng.randint(0, 50), {"ok": True}])
    if kind == 2:
        return encode([T_DELTA, call["call_id"], "one", "two", "text", b"\xff" * 4])
    return os.urandom(rng.randint(1, 40))


def _forged_control(rng: random.Random) -> bytes:
    return encode(rng.choice([[C_AUTHORIZE, "x"], [C_FENCE], [C_FINISH, 1, 2, 3],
                              [99, "?"], "not a list"]))


def attacker(state: ChaosState, rng: random.Random) -> None:
    ep = Endpoints(os.path.join(str(state.daemon.state_dir), "run"))
    ctx = zmq.Context()
    front = ctx.socket(zmq.DEALER)
    events = ctx.socket(zmq.DEALER)
    sink_in = ctx.socket(zmq.DEALER)
    for sock in (front, events, sink_in):
        sock.linger = 0
        sock.sndhwm = 1000
    for sock in (front, events):
        load_credentials(state.daemon.credentials_path).apply(sock)
    front.connect(state.daemon.endpoint)
    events.connect(events_endpoint(state.daemon.endpoint))
    sink_in.connect(ep.sink_in)
    try:
        with state.daemon.client(timeout_s=5.0) as client:
            live: list[dict[str, Any]] = []
            n = 0
            while not state.stop.wait(rng.uniform(0.0, 0.004)):
                n += 1
                try:
                    roll = rng.random()
                    if roll < 0.4:
                        front.send_multipart(_garbage(rng), zmq.NOBLOCK)
                        state.count("garbage frames to the front socket")
                        while front.poll(0):
                            front.recv_multipart()
                    elif roll < 0.5:
                        events.send_multipart(_garbage(rng), zmq.NOBLOCK)
                        state.count("garbage frames to the events socket")
                        while events.poll(0):
                            events.recv_multipart()
                    else:
                        if n % 25 == 1:
                            live = client.status()["calls"]["running"]
                        sink_in.send(_forged(rng, live), zmq.NOBLOCK)
                        state.count("forged frames to the sink's worker socket")
                except (zmq.Again, TimeoutError):
                    continue
    finally:
        front.close()
        events.close()
        sink_in.close()
        ctx.term()


def control_attacker(state: ChaosState, rng: random.Random) -> None:
    """The sink's control socket belongs to the supervisor; a stranger's frames
    must be refused or ignored without harm."""
    ep = Endpoints(os.path.join(str(state.daemon.state_dir), "run"))
    ctx = zmq.Context()
    ctl = ctx.socket(zmq.DEALER)
    ctl.linger = 0
    ctl.connect(ep.sink_ctl)
    try:
        while not state.stop.wait(rng.uniform(0.05, 0.2)):
            ctl.send(_forged_control(rng))
            state.count("forged frames to the sink's control socket")
            while ctl.poll(0):
                ctl.recv()
    finally:
        ctl.close()
        ctx.term()


def main() -> int:
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    rng = seeded(args)
    with chaos_run({"workers_max": args.workers_max, "max_frame_bytes": 1024 * 1024}) as state:
        threads = [threading.Thread(target=attacker, args=(state, random.Random(rng.random())),
                                    daemon=True),
                   threading.Thread(target=control_attacker,
                                    args=(state, random.Random(rng.random())), daemon=True)]
        for t in threads:
            t.start()
        run_load(state, args, rng, steps, options)
        state.stop.set()
        for t in threads:
            t.join(timeout=10)
        with state.daemon.client(timeout_s=10.0) as client:
            alive = client.status()["op"] == "status_reply"
        ok = verdict(state, "chaos_input: malformed and forged frames on every socket")
        print(f"  daemon answers status at the end: {alive}")
    return 0 if ok and alive else 1


if __name__ == "__main__":
    sys.exit(main())
