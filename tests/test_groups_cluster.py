"""Cluster mode: a model group's call survives a take-over. The host that
takes it resolves the group by its name in its own config and chooses the
deployment afresh (README, "Model groups"); a real NATS JetStream cluster,
the real emulator, and host B played by a ledger, as in
tests/test_cluster_daemon.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess
from streamfence.devtools.nats_cluster import NatsCluster
from tests.harness import as_host
from tests.test_cluster_daemon import (
    _host,
    _take_as_host_b,
    _wait_forgotten,
    _wait_runs,
)

pytestmark = pytest.mark.slow

GROUP = """
[groups.grp]
deployments = [{profile = "emu", model = "gpt-emu#gback"}]
"""


def test_a_group_call_won_back_runs_on_the_groups_deployment(
        tmp_path: Path, emulator: EmulatorProcess, emu: EmulatorClient,
        nats: NatsCluster) -> None:
    """Host A runs a group's call; host B takes it at epoch 2 and falls
    silent; A takes it back at epoch 3 as a call of the group (its record
    names the group) and completes it on the group's deployment."""
    emu.script("gback", [{"fault": "ok", "chunks": 600, "chunk_delay_s": 0.05},  # A, 30 s
                         {"fault": "ok", "chunks": 6, "text": "won back"}])
    a = _host(tmp_path, emulator, nats, "host-a", 2.0)
    a.config_path.write_text(a.config_path.read_text() + GROUP)
    a.start()
    try:
        with a.client() as client:
            call_id = client.submit("grp", {"model": "grp", "messages": [
                {"role": "user", "content": "hi"}]}, subscribe=False)
        _wait_runs(nats, call_id, "host a's first runs")
        _take_as_host_b(nats, call_id, beat=True)
        _wait_forgotten(a, 20, "host a to forget the call")
        with a.client() as client:
            done = client.result(call_id, wait_s=30.0)
        assert done is not None and done["status"] == "completed", done
        assert done["response"]["content"] == "won back"
        assert [r["model"] for r in emu.log("gback")] == ["gpt-emu"] * 2
        history = a.journal_rows("SELECT attempt, profile, model FROM attempts WHERE "
                                 "call_id = ? ORDER BY attempt", call_id)
        assert history == [(1, "emu", "gpt-emu#gback"), (3, "emu", "gpt-emu#gback")]
        log = as_host(nats, "reader", lambda ledger: ledger.read(call_id))
        assert log, "the call's log in the cluster"
    finally:
        a.cleanup()
