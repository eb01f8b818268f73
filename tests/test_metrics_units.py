"""The metrics' pure parts (issue 15, item 3): the histograms the daemon keeps
for `status`, the metric families a status reply becomes (parsed back with
Prometheus's own text parser), /readyz's rule, and the gateway's answers
when the supervisor does not answer."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from streamfence.gateway.metrics import DaemonStatus, Health, _Snapshot, families, missing
from streamfence.protocol.histograms import Histogram
from streamfence.protocol.internal.outcome import (
    AttemptDiag,
    AttemptError,
    AttemptOutcome,
    ErrorClass,
)
from streamfence.protocol.states import FenceReason
from streamfence.sink.commits import COMMIT_AFTER_S
from streamfence.sink.state import SinkState
from streamfence.sink.store import TranscriptStore
from streamfence.supervisor.histograms import Histograms, attempt_outcome
from tests.fakes import Nobody


def test_a_histogram_counts_each_value_in_its_inclusive_bucket() -> None:
    h = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 1.0, 7.0):
        h.observe(value)
    assert h.to_map() == {"le": [0.1, 1.0], "buckets": [2, 3], "count": 4, "sum": 8.15}


def test_the_supervisors_histograms_and_attempt_outcomes() -> None:
    hist = Histograms()
    hist.accepted("c", 10.0)
    hist.accepted("c", 11.0)  # accepted once (a staged call is released once, but be safe)
    hist.call_done("c", 12.5)
    hist.call_done("c", 13.0)  # observed once
    hist.accepted("gone", 1.0)
    hist.forget("gone")
    hist.call_done("gone", 2.0)
    hist.attempt_ended(AttemptOutcome(ok=True, diag=AttemptDiag(first_chunk_ms=250.0)))
    hist.attempt_ended(AttemptOutcome(ok=False))  # no chunk: nothing to observe
    hist.attempt_ended(None)  # fenced
    m = hist.to_map()
    assert (m["call_duration_seconds"]["count"], m["call_duration_seconds"]["sum"]) == (1, 2.5)
    assert (m["attempt_first_chunk_seconds"]["count"],
            m["attempt_first_chunk_seconds"]["sum"]) == (1, 0.25)
    error = AttemptError(ErrorClass.TRANSIENT, "connection_error", "gone")
    assert attempt_outcome(AttemptOutcome(ok=True), None) == "ok"
    assert attempt_outcome(AttemptOutcome(ok=False, error=error), FenceReason.STALE) == "error"
    assert attempt_outcome(None, FenceReason.STALE) == "stale"


def test_the_sink_observes_delta_latency_once_per_commit_of_deltas(tmp_path: Path) -> None:
    state = SinkState(TranscriptStore(str(tmp_path / "t.db")), Nobody(), Nobody())
    try:
        state.commits.commit()  # nothing pending: nothing observed
        state.commits.pending_events = 3  # read 0.2 s ago (the loop set commit_due then)
        state.commits.commit_due = time.monotonic() - 0.2 + COMMIT_AFTER_S
        state.commits.commit()
        latency = state.stats()["delta_latency"]
    finally:
        state.store.close()
    assert latency["count"] == 1 and 0.2 <= latency["sum"] < 5.0, latency


STATUS: dict[str, Any] = {
    "role": "admin",
    "processes": {"supervisor": 1, "sink": 2, "zygote": 3},
    "workers": [{"state": "idle"}, {"state": "busy"}],
    "pool": {"spare": 2, "max": 8, "spawned_total": 5, "killed_total": 1},
    "calls": {"by_state": {"running": 1}, "in_flight_bytes": 120},
    "breakers": [{"session_id": "s1", "provider": "oa", "state": "open"},
                 {"session_id": "s2", "provider": "oa", "state": "open"}],
    "storage": None,
    "counters": {"calls_accepted": 4, "calls_completed": 3, "attempts.ok": 3,
                 "attempts.stale": 1, "retries": 1, "bad_input.bad_message": 2,
                 "sink_restarts": 1, "journal_fsyncs": 9},
    "sink": {"accepted": 40, "dropped_by_verdict": {"stale_attempt": 2, "gap": 0},
             "storage_fault": None},
    "histograms": {"call_duration_seconds": {"le": [1.0, 5.0], "buckets": [1, 2],
                                             "count": 3, "sum": 9.5}},
}


def _parse(status: dict[str, Any] | None) -> tuple[dict[str, str], dict[Any, float]]:
    text = generate_latest(_Snapshot(families(status, ["oa", "an"]))).decode()
    types, samples = {}, {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return types, samples


def test_a_status_reply_as_prometheus_families() -> None:
    types, samples = _parse(STATUS)
    assert all(name.startswith("streamfence_") for name in types)
    assert all(name.endswith("_total") for (name, _), _ in samples.items()
               if types.get(name.removesuffix("_total")) == "counter")
    assert samples[("streamfence_up", ())] == 1.0
    assert samples[("streamfence_calls_total", (("status", "completed"),))] == 3.0
    assert samples[("streamfence_calls_total", (("status", "failed"),))] == 0.0
    assert ("streamfence_calls_total", (("status", "accepted"),)) not in samples
    assert samples[("streamfence_stale_kills_total", ())] == 1.0
    assert samples[("streamfence_journal_fsyncs_total", ())] == 9.0
    assert samples[("streamfence_attempts_total", (("outcome", "worker_died"),))] == 0.0
    assert samples[("streamfence_fence_refused_deltas_total",
                    (("reason", "stale_attempt"),))] == 2.0
    assert samples[("streamfence_bad_input_total", (("code", "bad_message"),))] == 2.0
    assert samples[("streamfence_child_restarts_total", (("process", "sink"),))] == 1.0
    assert samples[("streamfence_pool_workers", (("state", "idle"),))] == 1.0
    assert samples[("streamfence_breakers", (("provider", "oa"), ("state", "open")))] == 2.0
    assert samples[("streamfence_breakers", (("provider", "an"), ("state", "open")))] == 0.0
    assert types["streamfence_call_duration_seconds"] == "histogram"
    assert samples[("streamfence_call_duration_seconds_bucket", (("le", "5.0"),))] == 2.0
    assert samples[("streamfence_call_duration_seconds_bucket", (("le", "+Inf"),))] == 3.0
    assert samples[("streamfence_call_duration_seconds_sum", ())] == 9.5
    # No answer: only that.
    assert _parse(None)[1] == {("streamfence_up", ()): 0.0}


def test_readiness() -> None:
    assert missing(STATUS) == []
    down = dict(STATUS, processes={"supervisor": 1, "sink": None, "zygote": 3},
                workers=[{"state": "busy"}], storage={"code": "storage_full", "message": "full"},
                sink={"storage_fault": "SQLITE_FULL"})
    lacking = missing(down)
    assert [line.split(":")[0] for line in lacking] == ["sink", "sink", "journal", "workers"]
    assert "none idle (1 in the pool, 1 busy)" in lacking[-1]


def test_without_the_supervisor_metrics_say_down_and_readyz_503(tmp_path: Path) -> None:
    """Nothing serves the endpoint: /readyz 503 with what is missing, /metrics
    only `streamfence_up 0`; scrapes that come together share one request."""
    endpoint = f"ipc://{tmp_path}/nobody"

    async def scenario() -> None:
        status = DaemonStatus(endpoint, None, timeout_s=0.2)
        started = time.monotonic()
        first, second = await asyncio.gather(status.get(), status.get())
        assert first == second == "the supervisor did not answer status within 0.2 s"
        assert time.monotonic() - started < 1.5  # one request, not two in a row
        status.close()

        health = Health(endpoint, None, ["oa"], {}, timeout_s=0.2)
        app = web.Application()
        health.register(app)
        async with TestClient(TestServer(app)) as client:
            ready = await client.get("/readyz")
            assert ready.status == 503
            assert await ready.json() == {"ready": False, "missing": [first]}
            scraped = await client.get("/metrics")
            assert scraped.status == 200
            assert "streamfence_up 0.0" in await scraped.text()

    asyncio.run(scenario())
