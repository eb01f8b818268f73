"""Issue 15, acceptance 4: the gateway's /metrics, scraped from a real daemon
with `[http] listen` and parsed with Prometheus's own text parser; after a
scripted zombie the stale-kill counter is 1 and the fence's refusals match
the sink's counts in `status`. /readyz answers 200 on a ready daemon. One
daemon for the module."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from streamfence.devtools.emulator.control import (
    EmulatorClient,
    EmulatorProcess,
    emulator_profile,
)
from tests.harness import DaemonProcess, free_port, wait_until

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "hello"}]
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5.0) as reply:
            return int(reply.status), bytes(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory,
            emulator: EmulatorProcess) -> Iterator[tuple[DaemonProcess, str]]:
    port = free_port()
    daemon = DaemonProcess(
        Path(tmp_path_factory.mktemp("metrics")) / "state",
        {"oa": dict(emulator_profile("openai", emulator.base_url), stale_timeout_s=1.0,
                    max_attempts=3)},
        tables={"http": {"listen": f"127.0.0.1:{port}"}})
    daemon.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _get(url + "/healthz")[0] == 200, 30.0,
                   f"the gateway to answer {url}/healthz")
        yield daemon, url
    finally:
        daemon.cleanup()


def _scrape(url: str) -> tuple[dict[str, str], Samples]:
    """/metrics parsed: each family's type, and every sample by (name, labels)."""
    code, body = _get(url + "/metrics")
    assert code == 200, (code, body[:500])
    types: dict[str, str] = {}
    samples: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return types, samples


def test_readyz_says_200_on_a_ready_daemon(gateway: tuple[DaemonProcess, str]) -> None:
    _, url = gateway
    code, body = _get(url + "/readyz")
    assert code == 200 and json.loads(body) == {"ready": True}, body


def test_metrics_after_a_zombie(gateway: tuple[DaemonProcess, str],
                                emu: EmulatorClient) -> None:
    daemon, url = gateway
    types, before = _scrape(url)
    assert before[("streamfence_up", ())] == 1.0
    assert types["streamfence_stale_kills"] == "counter"
    assert types["streamfence_attempt_first_chunk_seconds"] == "histogram"
    assert before[("streamfence_stale_kills_total", ())] == 0.0

    emu.script("zombie", [{"fault": "stall", "after": 0, "stall_s": 4.0}, {"fault": "ok"}])
    with daemon.client(timeout_s=10.0) as client:
        done = client.run("oa", {"model": "gpt-emu#zombie", "messages": QUESTION},
                          timeout_s=30.0)
        assert done["status"] == "completed" and done["attempts"] == 2, done
        assert [r["fault"] for r in emu.log("zombie")] == ["stall", "ok"]

        def counted() -> Samples | None:
            _, now = _scrape(url)  # a status reply is reused for up to 1 s
            return now if now[("streamfence_calls_total", (("status", "completed"),))] \
                >= before[("streamfence_calls_total", (("status", "completed"),))] + 1 \
                else None

        after = wait_until(counted, 10.0, "/metrics to count the zombie's call")
        assert after is not None
        sink = client.status()["sink"]
    assert after[("streamfence_stale_kills_total", ())] == 1.0
    assert after[("streamfence_attempts_total", (("outcome", "stale"),))] == 1.0
    assert after[("streamfence_attempts_total", (("outcome", "ok"),))] >= 1.0
    assert after[("streamfence_retries_total", ())] >= 1.0
    # Its accept, then its retry's epoch, seconds apart: two syncs at least.
    assert after[("streamfence_journal_fsyncs_total", ())] >= \
        before[("streamfence_journal_fsyncs_total", ())] + 2
    refused = {dict(labels)["reason"]: value for (name, labels), value in after.items()
               if name == "streamfence_fence_refused_deltas_total"}
    assert refused and refused == {r: float(n) for r, n in sink["dropped_by_verdict"].items()}
    assert after[("streamfence_sink_deltas_accepted_total", ())] == float(sink["accepted"])
    for name in ("streamfence_attempt_first_chunk_seconds", "streamfence_call_duration_seconds",
                 "streamfence_delta_latency_seconds"):
        count = after[(name + "_count", ())]
        assert count >= 1.0 and after[(name + "_bucket", (("le", "+Inf"),))] == count, name
    assert after[("streamfence_pool_workers", (("state", "idle"),))] >= 1.0
