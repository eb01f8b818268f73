"""The bridge between a polling loop and the ledger's thread
(streamfence/cluster/bridge.py), on a real NATS cluster: however the two
threads interleave, every operation handed over is started and its answer
reaches the owner's thread, woken through `fd`."""

from __future__ import annotations

import asyncio
import select
import sys
import threading
import time

import pytest

from streamfence.cluster.bridge import LedgerBridge
from streamfence.cluster.settings import ClusterSettings
from streamfence.devtools.nats_cluster import NatsCluster

pytestmark = pytest.mark.slow
POSTS = 200_000
SUBMITS = 5_000


async def _answer(i: int) -> int:
    await asyncio.sleep(0)
    return i


def test_no_answer_is_left_without_a_wake(nats: NatsCluster) -> None:
    """The owner polls `fd` as the sink does and runs `run_done` only when it
    is readable, while answers land from another thread at every moment (a
    thread of its own posting, and the ledger's loop answering submits, in
    batches and alone): each one arrives. A wake lost between the owner's
    read of the pipe and its look at the answers left the calls' appends of
    a chaos run waiting for ever."""
    bridge = LedgerBridge(ClusterSettings(tuple(nats.urls), "bridge-test", replicas=3))
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads interleave every few bytecodes
    posted: list[int] = []
    answered: list[int] = []

    def post_all() -> None:
        for i in range(POSTS):
            bridge.post(lambda i=i: posted.append(i))  # type: ignore[misc]
    poster = threading.Thread(target=post_all, daemon=True)
    try:
        poster.start()
        for at in range(0, SUBMITS, 5):
            with bridge.batch():
                for i in range(at, at + 4):
                    bridge.submit(_answer(i), answered.append)
            bridge.submit(_answer(at + 4), answered.append)
            if select.select([bridge.fd], [], [], 0)[0]:
                bridge.run_done()
        poster.join(60.0)
        deadline = time.monotonic() + 60.0
        while len(posted) < POSTS or len(answered) < SUBMITS:
            readable = select.select([bridge.fd], [], [], 2.0)[0]
            assert readable, (f"{POSTS - len(posted)} posts and {SUBMITS - len(answered)} "
                              f"answers landed, and fd is not readable")
            assert time.monotonic() < deadline, "the answers kept coming for 60 s"
            bridge.run_done()
        assert posted == list(range(POSTS)) and sorted(answered) == list(range(SUBMITS))
    finally:
        sys.setswitchinterval(interval)
        bridge.close()
