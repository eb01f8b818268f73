"""The supervisor's owners (`Parts`), each built after what it needs by
`build_parts`; the daemon starts its children once they all exist.
"""

from __future__ import annotations

import functools
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from streamfence.config.model import DaemonConfig
from streamfence.protocol.internal.workers import ZygoteCommand
from streamfence.supervisor import storepair
from streamfence.supervisor.attempts import AttemptDriver
from streamfence.supervisor.breaker import Breakers
from streamfence.supervisor.calls_view import CallsView
from streamfence.supervisor.clients import Clients
from streamfence.supervisor.front import Front
from streamfence.supervisor.journal import Journal
from streamfence.supervisor.pool import Pool
from streamfence.supervisor.sinklink import SinkLink, StatsCallback
from streamfence.supervisor.status import daemon_facts, status_of
from streamfence.supervisor.tracing import CallTracer
from streamfence.workers.liveness import LivenessTable

if TYPE_CHECKING:  # cluster mode only: it brings nats
    from streamfence.supervisor.clusterlink import ClusterLink

Socket = zmq.Socket[bytes]
Sockets = tuple[Socket, Socket, Socket, Socket]  # workers', logs', clients', the sink's
SinkStats = Callable[[SinkLink, StatsCallback], None]


@dataclass(frozen=True, slots=True)
class Parts:
    """The supervisor's owners, built in dependency order by `Daemon._build`:
    journal (journal.db), pool (workers, the `workers` socket, liveness),
    clients (the client socket's sends, each live call's listeners, result waiters),
    sink (SinkLink: requests in flight on `sink.ctl`), breakers, driver (calls,
    queue, fall-backs), front (request handling: admission, acceptance).
    `counters` are tallies each incremented by one owner (the daemon's: sink
    and zygote restarts), read by `status`."""

    journal: Journal
    pool: Pool
    clients: Clients
    sink: SinkLink
    breakers: Breakers
    driver: AttemptDriver
    front: Front
    counters: Counter[str]
    logs: zmq.Socket[bytes]
    cluster: ClusterLink | None = None  # cluster mode (ARCHITECTURE §4.17)
    tracer: CallTracer | None = None  # `[tracing]`: the calls' spans


def build_parts(cfg: DaemonConfig, journal: Journal, live: LivenessTable,
                sockets: Sockets,
                cluster: ClusterLink | None, to_zygote: Callable[[ZygoteCommand], None],
                sink_stats: SinkStats, pids: Callable[[], dict[str, int | None]],
                auth_counts: Callable[[], dict[str, int]],
                connections: Callable[[], dict[str, int]], transcript_path: str,
                tracer: CallTracer | None = None) -> Parts:
    """Every owner, in dependency order. `sockets`: the workers', logs' and
    clients' (bound) and the sink's (connected); `to_zygote`, `sink_stats`,
    `pids`, `auth_counts` and `connections`: what the daemon's children, auth
    and client connections answer."""
    workers_sock, logs_sock, front_sock, sink_sock = sockets
    clock = time.monotonic
    counters: Counter[str] = Counter()
    pool = Pool(to_zygote, workers_sock, live, slots=cfg.workers_max,
                spare=cfg.workers_spare, max_workers=cfg.workers_max,
                refill_wait_s=cfg.workers_refill_wait_s,
                peak_half_life_s=cfg.workers_peak_half_life_s)
    clients = Clients(front_sock, counters)
    sink = SinkLink(sink_sock, clock)
    breakers = Breakers(cfg.breaker_threshold, cfg.breaker_cooldown_s, clock)
    driver = AttemptDriver(cfg, journal, pool, sink, clients, breakers, counters, clock,
                           random.Random(), transcript_path, cluster, tracer)
    status = functools.partial(status_of, pool, driver, breakers,
                               functools.partial(sink_stats, sink), counters, pids,
                               auth_counts, connections, journal.fault_view, journal.fsyncs,
                               cluster.stats if cluster is not None else None,
                               functools.partial(daemon_facts, cfg, clock(), clock),
                               journal.usage)
    journal.usage.use(cfg.prices)
    calls = CallsView(os.path.join(cfg.state_dir, storepair.JOURNAL), driver.calls, pool)
    front = Front(cfg, journal, driver, clients, sink, breakers, counters, clock,
                  transcript_path, status, calls, cluster)
    if cluster is not None and driver.takeover is not None:
        cluster.on_taken = driver.takeover.adopt
        cluster.knows = driver.calls.has
        cluster.on_cancel = front.cancel_for_peer
    return Parts(journal, pool, clients, sink, breakers, driver, front, counters, logs_sock,
                 cluster, tracer)
