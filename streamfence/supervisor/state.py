"""The supervisor's shared in-memory state, one object passed to the parts
of the loop (front handling, attempt driving, fan-out)."""

from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from streamfence.supervisor.breaker import Breakers
from streamfence.supervisor.calls import Call
from streamfence.supervisor.config import DaemonConfig
from streamfence.supervisor.journal import Journal
from streamfence.supervisor.pool import Pool
from streamfence.supervisor.sinklink import SinkLink
from streamfence.workers.liveness import LivenessTable


@dataclass
class DaemonState:
    config: DaemonConfig
    journal: Journal
    pool: Pool
    sink: SinkLink
    live: LivenessTable
    front: zmq.Socket[bytes]
    workers_sock: zmq.Socket[bytes]
    clock: Callable[[], float]
    rng: random.Random
    breakers: Breakers
    calls: dict[str, Call] = field(default_factory=dict)
    queue: deque[str] = field(default_factory=deque)
    counters: Counter[str] = field(default_factory=Counter)
    # Profiles whose provider refused `stream_options`: remembered for the run.
    no_stream_options: set[str] = field(default_factory=set)
    # Profiles switched to non-streaming (streaming refused, keep-alive-only
    # streams, IAM denial of the streaming action): remembered for the run.
    no_streaming: set[str] = field(default_factory=set)
    # profile -> when its last non-streaming probe after a 5xx went out
    last_probe: dict[str, float] = field(default_factory=dict)
    # call_id -> {client identity: next seq owed}
    subscribers: dict[str, dict[bytes, int]] = field(default_factory=dict)
    # call_id -> encoded events of a live call, index = seq - 1 (for late subscribers)
    events: dict[str, list[bytes]] = field(default_factory=dict)
    next_token: int = 1
    # role -> pid of the daemon's own processes (supervisor, sink, zygote)
    processes: dict[str, int] = field(default_factory=dict)
