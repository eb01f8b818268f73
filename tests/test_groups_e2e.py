"""Issue 33, items 2 and 4: model groups with fallbacks, end to end. One
real daemon serves the module: two openai profiles on the real emulator,
told apart in its record by the model each deployment asks for (the
emulator's script key), a group of them in order and a weighted one, the
HTTP gateway in front, and an identity allowed one profile only."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import openai
import pytest

from streamfence.devtools.emulator.control import EmulatorClient
from streamfence.gateway.keys import http_key
from streamfence.protocol.client import Client, ClientError
from streamfence.protocol.credentials import load_credentials
from streamfence.protocol.keys import KeyStore
from tests.harness import DaemonProcess, free_port, healthy, wait_until
from tests.wires import DaemonFactory, request_for

pytestmark = pytest.mark.slow

PORT = free_port()
GROUPS = f"""
[groups.smart]
strategy = "ordered"
deployments = [{{profile = "ga", model = "emu-model#first"}},
               {{profile = "gb", model = "emu-model#second"}}]

[groups.spread]
strategy = "weighted"
deployments = [{{profile = "ga", model = "emu-model#w1", weight = 1}},
               {{profile = "gb", model = "emu-model#w2", weight = 2}}]

[identities.bob]
providers = ["ga"]

[http]
listen = "127.0.0.1:{PORT}"
"""
STALL = {"fault": "stall", "after": 0, "stall_s": 3.0}
# Also the next deployment's first-chunk budget: 1 s, not less, so that a
# loaded machine's pause does not make the answering deployment stale too.
FAST_STALE = {"stale_timeout_s": 1.0}


@pytest.fixture(scope="module")
def daemon(module_daemon: DaemonFactory) -> DaemonProcess:
    # Two stale attempts of one (session, profile) open its breaker, for good.
    proc = module_daemon({"ga": "openai", "gb": "openai"}, config_tail=GROUPS,
                         daemon={"breaker_threshold": 2, "breaker_cooldown_s": 600.0})
    wait_until(lambda: healthy(f"http://127.0.0.1:{PORT}"), 30.0, "the gateway to answer")
    return proc


def _run(client: Client, provider: str, key: str, **submit: Any) -> tuple[str, dict[str, Any]]:
    call_id = client.submit(provider, request_for("openai", key), **submit)
    events = list(client.events(call_id, timeout_s=30.0))
    return call_id, events[-1]


def _deployments(client: Client, call_id: str) -> list[tuple[str, str, str | None]]:
    """(profile, model, how) of each attempt, from the result's history."""
    result = client.result(call_id, wait_s=10.0)
    assert result is not None
    return [(a["profile"], a["model"], a["how"]) for a in result["diagnostics"]]


def test_a_stalled_then_failing_deployment_falls_to_the_next_then_is_skipped(
        daemon: DaemonProcess, emu: EmulatorClient) -> None:
    emu.script("first", [STALL, {"fault": "status", "status": 503}, STALL])
    session = {"session_id": "s-fallback", "options": FAST_STALE}
    with daemon.client() as client:
        # 1. The first deployment stalls: fenced, killed, the call completes on the second.
        call_id, done = _run(client, "smart", "zombie", **session)
        # (Failed once in CI, not reproduced in ~50 runs: say which attempt did what.)
        assert done["status"] == "completed" and done["attempts"] == 2, (
            done, client.result(call_id, wait_s=10.0))
        second = emu.log("second")
        assert len(second) == 1 and done["response"]["content"] == second[0]["text"]
        # The kill closed the stalled request's connection (the emulator saw it go).
        wait_until(lambda: emu.log("first")[0]["aborted"], 10.0,
                   "the emulator to record the stalled connection closed")
        assert emu.log("first")[0]["chunks_sent"] == 0
        assert _deployments(client, call_id) == [
            ("ga", "emu-model#first", "stale"), ("gb", "emu-model#second", "ended")]
        # 2. The first answers 503 before any text: the next deployment, at once.
        call_id, done = _run(client, "smart", "x", **session)
        assert done["status"] == "completed" and done["attempts"] == 2, done
        assert [r["status"] for r in emu.log("first")] == [200, 503]
        assert [d[:2] for d in _deployments(client, call_id)] == [
            ("ga", "emu-model#first"), ("gb", "emu-model#second")]
        # 3. It stalls again: its breaker (threshold 2) opens for the session.
        assert _run(client, "smart", "x", **session)[1]["status"] == "completed"
        breakers = [b for b in client.status()["breakers"] if b["session_id"] == "s-fallback"]
        assert breakers == [{"session_id": "s-fallback", "provider": "ga", "state": "open",
                             "consecutive_stale": 2}]
        # 4. The next call goes straight to the second: nothing reaches the first.
        call_id, done = _run(client, "smart", "x", **session)
        assert done["status"] == "completed" and done["attempts"] == 1, done
        assert len(emu.log("first")) == 3 and len(emu.log("second")) == 4
        assert [d[:2] for d in _deployments(client, call_id)] == [("gb", "emu-model#second")]
        # The profile itself is refused to the session: its breaker is open.
        with pytest.raises(ClientError) as refused:
            client.submit("ga", request_for("openai", "x"), session_id="s-fallback")
        assert refused.value.code == "breaker_open"


def test_under_restart_a_deployment_stalled_after_text_is_reset_and_the_next_answers(
        daemon: DaemonProcess, emu: EmulatorClient) -> None:
    emu.script("first", [dict(STALL, after=3)])
    with daemon.client() as client:
        call_id = client.submit("smart", request_for("openai", "x"), session_id="s-restart",
                                options=dict(FAST_STALE, on_partial="restart"))
        events = list(client.events(call_id, timeout_s=30.0))
        history = _deployments(client, call_id)
    ops = [e["op"] for e in events]
    assert ops.count("reset") == 1 and events[-1]["status"] == "completed", events[-1]
    after_reset = events[ops.index("reset") + 1:]
    text = "".join(e["data"] for e in after_reset if e.get("kind") == "text")
    assert text == events[-1]["response"]["content"] == emu.log("second")[0]["text"]
    assert [d[:2] for d in history] == [("ga", "emu-model#first"), ("gb", "emu-model#second")]


def test_weighted_group_splits_exactly_by_weight(daemon: DaemonProcess,
                                                 emu: EmulatorClient) -> None:
    """Smooth weighted round robin: weights 1 and 2 give second, first,
    second, then again; 6 calls split 2 and 4, in that order."""
    with daemon.client() as client:
        picked = []
        for _ in range(6):
            call_id, done = _run(client, "spread", "x")
            assert done["status"] == "completed", done
            picked += [d[0] for d in _deployments(client, call_id)]
    assert picked == ["gb", "ga", "gb", "gb", "ga", "gb"]
    assert (len(emu.log("w1")), len(emu.log("w2"))) == (2, 4)


def test_the_gateway_routes_a_group_and_lists_what_each_identity_may_use(
        daemon: DaemonProcess, emu: EmulatorClient) -> None:
    url = f"http://127.0.0.1:{PORT}"
    key = http_key(load_credentials(daemon.credentials_path))
    sdk = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    answer = sdk.chat.completions.create(model="smart", messages=[
        {"role": "user", "content": "hi"}])
    assert answer.model == "smart"
    assert answer.choices[0].message.content == emu.log("first")[0]["text"]

    def listed(key: str) -> set[str]:
        request = urllib.request.Request(url + "/v1/models",
                                         headers={"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(request, timeout=5.0) as reply:
            return {m["id"] for m in json.load(reply)["data"]}

    assert listed(key) == {"smart", "spread", "ga/*", "gb/*"}
    # bob may use profile ga only: no group (each has a deployment on gb) ...
    bob = KeyStore(daemon.state_dir / "keys").register("bob", daemon.endpoint)
    assert listed(http_key(bob)) == {"ga/*"}
    # ... and the daemon refuses him the group as if it did not exist.
    with Client(credentials=bob, timeout_s=10.0) as client, \
            pytest.raises(ClientError) as refused:
        client.submit("smart", request_for("openai", "x"))
    assert refused.value.code == "unknown_provider"
    assert "'smart'" in refused.value.message and "groups" not in refused.value.message


def test_the_attempt_history_survives_a_kill_9(daemon: DaemonProcess,
                                               emu: EmulatorClient) -> None:
    """Killed while the first deployment stalls, restarted: the recovered
    call completes, and its history still names each attempt's deployment.
    (Last in the module: it restarts the module's daemon.)"""
    emu.script("first", [dict(STALL, stall_s=30.0)])
    with daemon.client() as client:
        call_id = client.submit("smart", request_for("openai", "x"), session_id="s-kill")
        wait_until(lambda: emu.log("first"), 10.0, "the first attempt to reach the emulator")
    assert daemon.proc is not None
    daemon.proc.kill()
    daemon.proc.wait(timeout=10)
    daemon.stop()
    daemon.start()
    with daemon.client() as client:
        done = list(client.events(call_id, timeout_s=30.0))[-1]
        assert done["status"] == "completed", done
        history = _deployments(client, call_id)
    # The recovered call chooses afresh: the first deployment again (it answers now).
    assert [d[:2] for d in history] == [("ga", "emu-model#first")] * 2
    assert history[0][2] is None  # it never ended: the daemon died under it
    assert done["response"]["content"] == emu.log("first")[1]["text"]
