"""`GET /metrics` and `GET /readyz` on the gateway (docs/METRICS.md).

Both come from the supervisor's admin `status` (docs/PROTOCOL.md "status"),
asked for at the request, as the admin identity (`<state_dir>/keys/
local.credentials`; no credentials under `auth = "none"`), with a short
timeout: nothing polls in the background. Requests that come together
share one status request, and a reply younger than REUSE_S serves again, so
a flood of scrapes costs the supervisor at most about one status a second.

`families` turns a status reply into Prometheus metric families (the
custom-collector pattern: built at each scrape, nothing kept between); the
histograms are the ones the daemon keeps (status `histograms`), since the
gateway sees only its own calls. `missing` is /readyz's rule: the sink runs
and is not waiting out a storage fault, the journal takes submits, and a
warm worker is idle.

Neither endpoint takes a key: the gateway binds loopback only, and they
show counts and durations, never a call, a session or a key (breakers are
counted per provider, not per session); identities appear only as a label
of the usage families (gateway/metrics_usage.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import zmq
from aiohttp import web
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from streamfence.gateway.metrics_usage import usage_families
from streamfence.protocol.client_async import AsyncClient
from streamfence.protocol.client_router import ClientError
from streamfence.protocol.credentials import LOCAL_NAME, CredentialsError, load_credentials
from streamfence.protocol.messages import CallStatus
from streamfence.protocol.states import CallState, FenceReason, WorkerState

log = logging.getLogger("streamfence.gateway")

STATUS_TIMEOUT_S = 2.0  # well inside a scraper's timeout (Prometheus: 10 s by default)
REUSE_S = 1.0
ATTEMPT_OUTCOMES = ("ok", "error", *(r.value for r in FenceReason))  # protocol/histograms.py
HISTOGRAMS = {  # status `histograms` key -> (metric, help)
    "attempt_first_chunk_seconds": (
        "streamfence_attempt_first_chunk_seconds",
        "Time to first delta: from an attempt's start in its worker to the provider's first "
        "chunk (attempts whose final the sink accepted)"),
    "call_duration_seconds": (
        "streamfence_call_duration_seconds",
        "From a call's acceptance (or its recovery at a start) to its stored done event"),
    "delta_latency_seconds": (
        "streamfence_delta_latency_seconds",
        "Sink, per group commit of deltas: from the loop turn that read its first delta to "
        "the hand-off of its events to subscribers after the commit"),
}


class DaemonStatus:
    """The supervisor's admin status, asked for on demand (module docstring)."""

    def __init__(self, endpoint: str, credentials: Path | None,
                 timeout_s: float = STATUS_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._endpoint = endpoint
        self._credentials = credentials
        self._timeout_s = timeout_s
        self._clock = clock
        self._client: AsyncClient | None = None
        self._asking: asyncio.Task[dict[str, Any] | str] | None = None
        self._last: tuple[float, dict[str, Any]] | None = None

    async def get(self) -> dict[str, Any] | str:
        """The status reply, or why there is none (one line)."""
        last = self._last
        if last is not None and self._clock() - last[0] < REUSE_S:
            return last[1]
        task = self._asking
        if task is None:
            task = self._asking = asyncio.ensure_future(self._ask())
            task.add_done_callback(self._asked)
        # Shielded: a scraper that goes away does not cancel the others' answer.
        return await asyncio.shield(task)

    def _asked(self, task: asyncio.Task[dict[str, Any] | str]) -> None:
        if self._asking is task:
            self._asking = None

    async def _ask(self) -> dict[str, Any] | str:
        try:
            if self._client is None:
                creds = load_credentials(self._credentials) if self._credentials else None
                self._client = AsyncClient(self._endpoint, timeout_s=self._timeout_s,
                                           credentials=creds)
            status = await asyncio.wait_for(self._client.status(), self._timeout_s + 0.5)
        except TimeoutError:
            self.close()  # a late reply must not meet the next request
            return f"the supervisor did not answer status within {self._timeout_s:g} s"
        except (ClientError, CredentialsError, OSError, zmq.ZMQError) as exc:
            self.close()
            return f"status failed: {exc}"
        if status.get("role") != "admin":
            return f"status answered for {status.get('identity')!r}, not an admin"
        self._last = (self._clock(), status)
        return status

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


class Health:
    """Owns the /metrics and /readyz handlers and their DaemonStatus."""

    def __init__(self, endpoint: str, keys_dir: str | None, providers: Iterable[str],
                 refused: Mapping[str, int], timeout_s: float = STATUS_TIMEOUT_S) -> None:
        creds = Path(keys_dir) / f"{LOCAL_NAME}.credentials" if keys_dir is not None else None
        self._status = DaemonStatus(endpoint, creds, timeout_s)
        self._providers = sorted(providers)
        self._refused = refused  # the gateway's own refusals, by code (app.py owns it)

    def register(self, app: web.Application) -> None:
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/readyz", self._readyz)
        app.on_cleanup.append(self._close)

    async def _close(self, _app: web.Application) -> None:
        self._status.close()

    async def _metrics(self, request: web.Request) -> web.Response:
        status = await self._status.get()
        if isinstance(status, str):
            log.warning("/metrics: %s", status)
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        body = encoder(_Snapshot([*families(status if isinstance(status, dict) else None,
                                            self._providers), _refusals(self._refused)]))
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _readyz(self, _request: web.Request) -> web.Response:
        status = await self._status.get()
        lacking = [status] if isinstance(status, str) else missing(status)
        if lacking:
            return web.json_response({"ready": False, "missing": lacking}, status=503)
        return web.json_response({"ready": True})


class _Snapshot(Collector):
    """One scrape's families, as the registry the encoder asks."""

    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        return self._metrics


# ---- the pure parts ---------------------------------------------------------------------

def _refusals(refused: Mapping[str, int]) -> Metric:
    family = CounterMetricFamily(
        "streamfence_gateway_refused_total", "HTTP requests the gateway refused before the "
        "daemon saw them (no key, not JSON, no route, untranslatable), by code",
        labels=["code"])
    for code, count in sorted(refused.items()):
        family.add_metric([code], count)
    return family


def missing(status: Mapping[str, Any]) -> list[str]:
    """What keeps the daemon from taking a call now; [] when ready."""
    lacking = []
    if (status.get("processes") or {}).get("sink") is None:
        lacking.append("sink: not running (it is being restarted)")
    fault = (status.get("sink") or {}).get("storage_fault")
    if fault:
        lacking.append(f"sink: waiting out a storage fault ({fault})")
    journal = status.get("storage")
    if journal:
        lacking.append(f"journal: storage fault, every submit is refused "
                       f"({journal.get('code')}: {journal.get('message')})")
    workers = status.get("workers") or []
    if not any(w.get("state") == WorkerState.IDLE.value for w in workers):
        busy = sum(1 for w in workers if w.get("state") == WorkerState.BUSY.value)
        lacking.append(f"workers: none idle ({len(workers)} in the pool, {busy} busy)")
    return lacking


def _num(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else 0.0


def _by(family: CounterMetricFamily | GaugeMetricFamily, values: Mapping[str, Any]
        ) -> CounterMetricFamily | GaugeMetricFamily:
    for label, value in sorted(values.items()):
        family.add_metric([label], _num(value))
    return family


def _prefixed(counters: Mapping[str, Any], prefix: str, known: Iterable[str] = ()
              ) -> dict[str, Any]:
    """`counters` named `prefix + label`, by label; the `known` labels at 0 if absent."""
    found: dict[str, Any] = dict.fromkeys(known, 0)
    found.update({k[len(prefix):]: v for k, v in counters.items() if k.startswith(prefix)})
    return found


def _histogram(name: str, doc: str, m: Any) -> HistogramMetricFamily | None:
    try:
        bounds = [float(b) for b in m["le"]]
        cumulative = [int(c) for c in m["buckets"]]
        count, total = int(m["count"]), float(m["sum"])
    except (KeyError, TypeError, ValueError):
        return None
    if len(bounds) != len(cumulative):
        return None
    buckets = [(repr(b), float(c)) for b, c in zip(bounds, cumulative, strict=True)]
    return HistogramMetricFamily(name, doc, buckets=[*buckets, ("+Inf", float(count))],
                                 sum_value=total)


def _cluster(cluster: Mapping[str, Any]) -> list[Metric]:
    """Cluster mode's (status `cluster`): hosts are labels; never a call."""
    lease = GaugeMetricFamily("streamfence_cluster_lease_age_seconds", "Since this host's "
                              "last beat was stored in the cluster (absent before the first)")
    if cluster.get("lease_age_s") is not None:
        lease.add_metric([], _num(cluster.get("lease_age_s")))
    hosts = cluster.get("hosts") or {}
    beats = _by(GaugeMetricFamily(
        "streamfence_cluster_host_beat_age_seconds", "Since this host saw another host's "
        "beat move, by host", labels=["host"]),
        {h: seen.get("beat_age_s") for h, seen in hosts.items()})
    lost = _by(GaugeMetricFamily(
        "streamfence_cluster_host_lease_lost", "1 for a host whose lease this host judged "
        "lost (its calls taken over), by host", labels=["host"]),
        {h: 1 if seen.get("lease_lost") else 0 for h, seen in hosts.items()})
    takes = _by(CounterMetricFamily(
        "streamfence_cluster_takes_total", "Calls of hosts whose lease lapsed, taken over by "
        "this host (won) or by another first (lost)", labels=["result"]),
        {"won": cluster.get("takes_won"), "lost": cluster.get("takes_lost")})
    return [
        GaugeMetricFamily("streamfence_cluster_connected", "1 while this host's supervisor "
                          "is connected to NATS", value=1 if cluster.get("connected") else 0),
        lease, beats, lost, takes,
        GaugeMetricFamily("streamfence_cluster_calls_owned", "Live calls this host owns in "
                          "the cluster", value=_num(cluster.get("calls_owned"))),
        CounterMetricFamily("streamfence_cluster_calls_moved_total", "Attempts that found "
                            "their call owned by another host",
                            value=_num(cluster.get("calls_moved"))),
        CounterMetricFamily("streamfence_cluster_appends_refused_total", "Appends of this "
                            "host JetStream refused (a later owner opened the call's epoch)",
                            value=_num(cluster.get("appends_refused"))),
        GaugeMetricFamily("streamfence_cluster_runs_waiting", "Runs the sink accepted that "
                          "wait for their calls' logs (the cluster has not stored them yet)",
                          value=_num(cluster.get("runs_waiting")))]


def families(status: Mapping[str, Any] | None, providers: Iterable[str] = ()) -> list[Metric]:
    """The metric families of one admin status reply (None: no answer)."""
    up = GaugeMetricFamily("streamfence_up", "1 if the supervisor answered this scrape's "
                           "status request, else 0", value=1.0 if status is not None else 0.0)
    if status is None:
        return [up]
    c = status.get("counters") or {}
    sink = status.get("sink") or {}
    pool = status.get("pool") or {}
    calls = status.get("calls") or {}
    out: list[Metric] = [up]

    def counter(name: str, doc: str, value: Any) -> None:
        out.append(CounterMetricFamily(name, doc, value=_num(value)))

    def gauge(name: str, doc: str, value: Any) -> None:
        out.append(GaugeMetricFamily(name, doc, value=_num(value)))

    processes = status.get("processes") or {}
    out.append(_by(GaugeMetricFamily(
        "streamfence_process_running", "1 if the daemon's process runs (a dead child awaiting "
        "its restart: 0)", labels=["process"]),
        {name: 1 if pid is not None else 0 for name, pid in processes.items()}))
    out.append(_by(CounterMetricFamily(
        "streamfence_child_restarts_total", "Restarts of a dead child process",
        labels=["process"]),
        {p: c.get(f"{p}_restarts", 0) for p in ("sink", "zygote", "gateway")}))
    # Calls.
    counter("streamfence_calls_accepted_total", "Calls accepted", c.get("calls_accepted"))
    done = _prefixed(c, "calls_", [s.value for s in CallStatus])
    done.pop("accepted", None)
    out.append(_by(CounterMetricFamily(
        "streamfence_calls_total", "Calls done, by status", labels=["status"]), done))
    out.append(_by(GaugeMetricFamily(
        "streamfence_calls_live", "Calls accepted and not done, by state", labels=["state"]),
        dict(dict.fromkeys((s.value for s in CallState if s is not CallState.DONE), 0),
             **(calls.get("by_state") or {}))))
    gauge("streamfence_calls_in_flight_bytes", "Request bytes of the calls not done",
          calls.get("in_flight_bytes"))
    # Attempts.
    out.append(_by(CounterMetricFamily(
        "streamfence_attempts_total", "Attempts ended: ok or error (final accepted), else the "
        "reason the supervisor fenced it", labels=["outcome"]),
        _prefixed(c, "attempts.", ATTEMPT_OUTCOMES)))
    counter("streamfence_stale_kills_total", "Attempts fenced as stale (no chunk within the "
            "stale timeout) and their workers killed",
            c.get("attempts.stale"))
    counter("streamfence_retries_total", "Attempts retried after a failed one", c.get("retries"))
    counter("streamfence_attempts_rebound_total", "Running attempts carried over a sink "
            "restart", c.get("attempts_rebound"))
    # Refusals and bad input.
    out.append(_by(CounterMetricFamily(
        "streamfence_bad_input_total", "Malformed or invalid client requests, by code",
        labels=["code"]), _prefixed(c, "bad_input.")))
    out.append(_by(CounterMetricFamily(
        "streamfence_refused_total", "Requests and connections refused, by code",
        labels=["code"]), _prefixed(c, "refused.")))
    counter("streamfence_auth_refused_total", "CURVE handshakes refused (unregistered key)",
            c.get("auth_refused"))
    gauge("streamfence_client_connections", "Client connections open", c.get("connections"))
    # The pool.
    workers: dict[str, int] = dict.fromkeys(
        (s.value for s in WorkerState if s is not WorkerState.DEAD), 0)  # dead: gone
    for w in status.get("workers") or []:
        workers[str(w.get("state"))] = workers.get(str(w.get("state")), 0) + 1
    out.append(_by(GaugeMetricFamily(
        "streamfence_pool_workers", "Worker processes, by state", labels=["state"]), workers))
    gauge("streamfence_pool_workers_max", "Worker processes at most", pool.get("max"))
    gauge("streamfence_pool_spare_target", "Idle workers kept warm beyond the busy ones",
          pool.get("spare"))
    counter("streamfence_pool_spawned_total", "Workers forked (first spares, growth and "
            "replacements)", pool.get("spawned_total"))
    counter("streamfence_pool_killed_total", "Workers killed (stale, cancelled, ...), each "
            "replaced by a fork", pool.get("killed_total"))
    # Breakers: per provider, never per session.
    breakers: dict[tuple[str, str], int] = {
        (p, s): 0 for p in providers for s in ("closed", "open", "half_open")}
    for b in status.get("breakers") or []:
        key = (str(b.get("provider")), str(b.get("state")))
        breakers[key] = breakers.get(key, 0) + 1
    family = GaugeMetricFamily(
        "streamfence_breakers", "(session, provider) breakers by state; closed: those with "
        "a streak of stale attempts below the threshold", labels=["provider", "state"])
    for (provider, state), n in sorted(breakers.items()):
        family.add_metric([provider, state], n)
    out.append(family)
    # The sink.
    counter("streamfence_sink_deltas_accepted_total", "Deltas the fence let through (stored)",
            sink.get("accepted"))
    out.append(_by(CounterMetricFamily(
        "streamfence_fence_refused_deltas_total", "Deltas the sink's fence refused, by reason",
        labels=["reason"]), sink.get("dropped_by_verdict") or {}))
    out.append(_by(CounterMetricFamily(
        "streamfence_sink_bad_frames_total", "Frames the sink could not read, by socket",
        labels=["socket"]), sink.get("bad_frames") or {}))
    counter("streamfence_sink_commits_total", "Transcript group commits", sink.get("commits"))
    counter("streamfence_sink_wal_rewinds_total", "Times the sink rewound transcript.db's WAL",
            sink.get("wal_rewinds"))
    gauge("streamfence_sink_storage_fault", "1 while the sink waits out a storage fault",
          1 if sink.get("storage_fault") else 0)
    gauge("streamfence_journal_storage_fault", "1 while the journal refuses submits for a "
          "storage fault", 1 if status.get("storage") else 0)
    counter("streamfence_journal_fsyncs_total", "Times the journal's WAL was synced to disk "
            "(group commit: an accept or an epoch waits for one)", c.get("journal_fsyncs"))
    if isinstance(cluster := status.get("cluster"), Mapping):
        out += _cluster(cluster)
    out += usage_families(status.get("usage"))
    # Histograms (the daemon's: every call's, not only the gateway's).
    for key, m in (status.get("histograms") or {}).items():
        if key in HISTOGRAMS and (h := _histogram(*HISTOGRAMS[key], m)) is not None:
            out.append(h)
    return out
