"""The body of a `status` reply: each owner's own view, filtered by who asks
(docs/PROTOCOL.md "status", docs/SECURITY.md)."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from streamfence.config.identities import Identity
from streamfence.config.model import DaemonConfig
from streamfence.supervisor.attempts import AttemptDriver
from streamfence.supervisor.breaker import Breakers
from streamfence.supervisor.pool import Pool
from streamfence.supervisor.usage import UsageBook

try:
    VERSION = version("streamfence")
except PackageNotFoundError:  # a checkout on sys.path without an install
    VERSION = "0+unknown"


def daemon_facts(config: DaemonConfig, started: float,
                 clock: Callable[[], float]) -> dict[str, Any]:
    """What an admin's status says first: this daemon's version, its uptime
    (monotonic seconds since `started`, its supervisor's start), its config
    file (absolute; nil: the built-in defaults) and its state dir (absolute)."""
    return {"version": VERSION, "uptime_s": round(clock() - started, 3),
            "config_path": config.config_path, "state_dir": os.path.abspath(config.state_dir)}


def status_of(pool: Pool, driver: AttemptDriver, breakers: Breakers,
              sink_stats: Callable[[Callable[[dict[str, Any], bool], None]], None],
              counters: Counter[str], pids: Callable[[], dict[str, int | None]],
              auth_counts: Callable[[], dict[str, int]],
              connections: Callable[[], dict[str, int]],
              storage: Callable[[], dict[str, Any] | None], journal_fsyncs: Callable[[], int],
              cluster: Callable[[], dict[str, Any]] | None, facts: Callable[[], dict[str, Any]],
              usage: UsageBook, user: Identity, reply: Callable[[dict[str, Any]], None]
              ) -> None:
    """Give `reply` the body of a `status_reply`: each owner's own view. An
    identity that is not an admin sees only its own calls (docs/SECURITY.md);
    an admin's reply waits for the sink's counters (`sink_stats`: asked for,
    not polled, so an idle daemon sleeps; the last known ones while the sink
    is down, or when it does not answer in time: `sink_answered` false).
    `calls.in_flight_bytes` is the request bytes the
    calls accepted and not done hold (the byte budgets: admission.py); an admin
    also sees them per owner and `in_flight_bytes_max`; `storage`, the
    journal's storage fault while one lasts (nil otherwise), and its WAL's
    fsyncs so far (`counters.journal_fsyncs`); `cluster`, in
    cluster mode, this host's view of it (clusterlink.py `stats`; nil
    otherwise), its `appends_refused` counting the sink's too; and
    `histograms` (protocol/histograms.py): the driver's, and the sink's
    `delta_latency` (taken out of its counters). `facts` (`daemon_facts`)
    come first: version, uptime_s, config_path, state_dir. `usage`: the
    all-time usage sums per (identity, provider, model) for an admin
    (UsageBook.totals); an identity's own budgets for any other."""
    if not user.is_admin:
        # Its calls' request bytes (`in_flight_bytes`) next to its budget for them.
        calls = dict(driver.calls.status(owner=user.name), max_in_flight_bytes=user.max_in_flight_bytes)
        reply({"identity": user.name, "role": user.role.value, "calls": calls,
               "budgets": usage.budgets(user)})
        return
    body = {"identity": user.name, "role": user.role.value, **facts(),
            "processes": pids(),
            "workers": pool.snapshot(),
            "pool": {"spare": pool.spare, "max": pool.max_workers,
                     "spawned_total": pool.spawned_total, "killed_total": pool.killed_total,
                     "retired_total": pool.retired_total,
                     "refills_deferred": pool.refills_deferred},
            "calls": driver.calls.status(),
            "breakers": breakers.snapshot(),
            "storage": storage(),
            "cluster": cluster() if cluster is not None else None,
            "connections": connections(),
            "usage": usage.totals(),
            "counters": dict(counters, **auth_counts(), journal_fsyncs=journal_fsyncs())}
    sink_stats(lambda stats, fresh: reply(_with_sink(body, driver.histograms.to_map(), stats,
                                                     fresh)))


def _with_sink(body: dict[str, Any], histograms: dict[str, Any], stats: dict[str, Any],
               fresh: bool) -> dict[str, Any]:
    sink = dict(stats)  # a copy: the last counters known are kept as they came
    latency = sink.pop("delta_latency", None)
    if isinstance(latency, dict):
        histograms["delta_latency_seconds"] = latency
    if body["cluster"] is not None:  # the sink, the only writer of the calls' logs, says
        body["cluster"] = dict(body["cluster"],
                               appends_refused=int(sink.get("cluster_engine_refused", 0)),
                               runs_waiting=int(sink.get("cluster_waiting_rows", 0)),
                               calls_waiting=int(sink.get("cluster_waiting_calls", 0)))
    return dict(body, sink=sink, sink_answered=fresh, histograms=histograms)
