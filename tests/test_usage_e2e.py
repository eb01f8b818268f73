"""Issue 33, item 3: usage sums and budgets, on a real daemon with its
gateway, the real emulator (its usage fields on each wire), the real
client, CLI and SDKs. One daemon for the module, restarted once.

- an identity with a 1,000-token budget is refused after it has used it:
  `budget_exceeded` on ZeroMQ, 429 from the gateway to both SDKs; a call
  accepted before the budget ran out finishes;
- `streamfence usage` and /metrics show sums equal to the usage the
  emulator sent (the done's `response.usage`, the SDK's `usage`); a client
  identity sees only its own;
- the sums survive a restart and a prune of every finished call;
- a reload (SIGHUP) takes a new budget.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess
from streamfence.gateway.keys import http_key
from streamfence.protocol.client import Client, ClientError
from streamfence.protocol.credentials import Credentials
from streamfence.protocol.keys import KeyStore
from tests.harness import DaemonProcess, free_port, healthy, wait_until
from tests.wires import WIRES, profile_for, request_for

pytestmark = pytest.mark.slow

PRICE_IN, PRICE_OUT = 2.5, 10.0
CONFIG_TAIL = """
[identities.alice]
tokens_per_day = 1000

[identities.bob]
role = "client"

[prices."emu-model#u"]
input_per_mtok = 2.5
output_per_mtok = 10
"""
LONG = "x" * 2400  # ~600 prompt tokens on the emulator's wires (chars / 4)


class Setup:
    def __init__(self, daemon: DaemonProcess, url: str, alice: Credentials,
                 bob: Credentials) -> None:
        self.daemon, self.url, self.alice, self.bob = daemon, url, alice, bob


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory,
          emulator: EmulatorProcess) -> Iterator[Setup]:
    port = free_port()
    daemon = DaemonProcess(
        Path(tmp_path_factory.mktemp("usage")) / "state",
        {wire: dict(profile_for(wire, emulator), stale_timeout_s=30.0) for wire in WIRES},
        tables={"http": {"listen": f"127.0.0.1:{port}"}})
    daemon.config_path.write_text(daemon.config_path.read_text() + CONFIG_TAIL)
    daemon.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: healthy(url), 30.0, f"the gateway to answer {url}/healthz")
        keys = KeyStore(daemon.state_dir / "keys")
        yield Setup(daemon, url, keys.register("alice", daemon.endpoint),
                    keys.register("bob", daemon.endpoint))
    finally:
        daemon.cleanup()


def _cli(daemon: DaemonProcess, *args: str, creds: Credentials | None = None
         ) -> subprocess.CompletedProcess[str]:
    extra = ["--credentials", str(daemon.state_dir / "keys" / f"{creds.name}.credentials")] \
        if creds is not None else []
    return subprocess.run([sys.executable, "-m", "streamfence.cli", *args, "--config",
                           str(daemon.config_path), *extra],
                          capture_output=True, text=True, timeout=60)


def _usage_json(daemon: DaemonProcess, *args: str, creds: Credentials | None = None
                ) -> dict[str, Any]:
    proc = _cli(daemon, "usage", "--json", *args, creds=creds)
    assert proc.returncode == 0, proc.stderr
    reply: dict[str, Any] = json.loads(proc.stdout)
    return reply


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _metrics(url: str, has: Callable[[Samples], bool] = lambda samples: True) -> Samples:
    """A scrape the supervisor answered (`streamfence_up` 1: a loaded machine
    can make it miss the gateway's 2 s for one scrape, which then has no
    daemon figures) that `has` what the test is after: a scrape may reuse a
    status up to 1 s old (docs/METRICS.md), from before the calls just made."""
    def scrape() -> Samples | None:
        with urllib.request.urlopen(url + "/metrics", timeout=5.0) as reply:
            body = reply.read().decode()
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for family in text_string_to_metric_families(body) for s in family.samples}
        return samples if samples.get(("streamfence_up", ())) == 1 and has(samples) else None
    return wait_until(scrape, 30.0, "a /metrics scrape the supervisor answered", interval=0.1)


def _tokens(usage: Any) -> tuple[int, int]:
    return int(usage["prompt_tokens"]), int(usage["completion_tokens"])


def test_a_budget_is_refused_once_used_across_a_restart_until_a_reload(
        setup: Setup, emu: EmulatorClient) -> None:
    """One story on one daemon (xdist may run a module's tests on different
    workers, each with its own daemon): used up, refused; still refused
    after a restart and a prune; a reload's higher budget lets it in."""
    _a_budget_is_refused_once_used(setup, emu)
    _sums_survive_a_restart_and_a_prune(setup)
    _a_reload_takes_a_new_budget(setup)


def _a_budget_is_refused_once_used(setup: Setup, emu: EmulatorClient) -> None:
    """alice (tokens_per_day 1000): two calls accepted together, the slow
    one still running when the fast one's usage passes the budget; the slow
    one finishes, and the next submit is refused on ZeroMQ and over HTTP."""
    emu.script("slow", [{"chunk_delay_s": 0.5, "chunks": 6}])
    used = 0
    with Client(credentials=setup.alice, timeout_s=30.0) as client:
        slow = client.submit("openai", request_for("openai", "slow"), subscribe=False)
        done = client.run("openai", request_for("openai", "u", "x" * 4000))
        assert done["status"] == "completed", done
        used += int(sum(_tokens(done["response"]["usage"])))
        assert used >= 1000, done["response"]["usage"]  # the budget is used up now ...
        assert client.result(slow) is None  # ... while the slow call runs (pending)
        # The done reaches the client from the sink; the supervisor counts the
        # call when the sink's answer to its finish comes (a submit between the
        # two is a call in flight's, PROTOCOL `budget_exceeded`): wait for it.
        wait_until(lambda: sum(r["input_tokens"] + r["output_tokens"]
                               for r in client.usage()["rows"]) >= used,
                   10.0, "the daemon to count the finished call's tokens")
        with pytest.raises(ClientError) as refused:
            client.submit("openai", request_for("openai", "u"), subscribe=False)
        finished = client.result(slow, wait_s=30.0)
        assert finished is not None and finished["status"] == "completed", finished  # accepted before: it finishes
        used += int(sum(_tokens(finished["response"]["usage"])))
    assert refused.value.code == "budget_exceeded", refused.value
    message = refused.value.message
    assert "tokens_per_day" in message and "of 1000" in message, message
    assert "resets at" in message and "T00:00:00Z" in message, message
    key = http_key(setup.alice)
    oa = openai.OpenAI(base_url=setup.url + "/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.RateLimitError) as http_refused:
        oa.chat.completions.create(model="emu-model#u", messages=[
            {"role": "user", "content": "hi"}])
    assert http_refused.value.status_code == 429
    assert http_refused.value.code == "budget_exceeded", http_refused.value.body
    assert "tokens_per_day" in str(http_refused.value.message)
    an = anthropic.Anthropic(base_url=setup.url, api_key=key, max_retries=0)
    with pytest.raises(anthropic.RateLimitError) as an_refused:
        an.messages.create(model="emu-model#u", max_tokens=64, messages=[
            {"role": "user", "content": "hi"}])
    assert an_refused.value.status_code == 429
    with setup.daemon.client() as admin:
        counters = admin.status()["counters"]
    assert counters.get("refused.budget_exceeded") == 3, counters
    # Its own view: the sums, and the budget with what is used of it.
    mine = _usage_json(setup.daemon, creds=setup.alice)
    assert [b["used"] for b in mine["budgets"]] == [used], mine
    assert {r["identity"] for r in mine["rows"]} == {"alice"}, mine


def _emulated(usage: dict[str, Any]) -> tuple[int, int]:
    """(input, output) tokens of the emulator's record of what it sent, in
    whichever wire's names."""
    def first(*names: str) -> int:
        return int(next(usage[n] for n in names if n in usage))
    return (first("prompt_tokens", "input_tokens", "inputTokens"),
            first("completion_tokens", "output_tokens", "outputTokens"))


def _bob_calls(setup: Setup, emu: EmulatorClient) -> dict[tuple[str, str], list[float]]:
    """bob's calls on each wire over ZeroMQ and one over HTTP: the usage each
    got, per (profile, model): [calls, input, output]."""
    sums: dict[tuple[str, str], list[float]] = {}

    def add(profile: str, model: str, usage: tuple[int, int]) -> None:
        row = sums.setdefault((profile, model), [0, 0, 0])
        row[0] += 1
        row[1] += usage[0]
        row[2] += usage[1]

    with Client(credentials=setup.bob, timeout_s=30.0) as client:
        for wire in WIRES:
            for text in ("hello", LONG):
                done = client.run(wire, request_for(wire, "u", text))
                assert done["status"] == "completed", done
                sent = _emulated(emu.log("u")[-1]["usage"])  # in the wire's own fields
                assert _tokens(done["response"]["usage"]) == sent, (wire, done, sent)
                add(wire, "emu-model#u", sent)
    oa = openai.OpenAI(base_url=setup.url + "/v1", api_key=http_key(setup.bob), max_retries=0)
    stream = oa.chat.completions.create(model="emu-model#h", stream=True, messages=[
        {"role": "user", "content": LONG}], stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
    add("openai", "emu-model#h", (usage.prompt_tokens, usage.completion_tokens))
    return sums


def test_usage_and_metrics_equal_the_emulators_usage(setup: Setup,
                                                     emu: EmulatorClient) -> None:
    sums = _bob_calls(setup, emu)
    mine = _usage_json(setup.daemon, creds=setup.bob)
    assert {r["identity"] for r in mine["rows"]} == {"bob"}, mine  # its own only
    got = {(r["profile"], r["model"]): [r["calls"], r["input_tokens"], r["output_tokens"]]
           for r in mine["rows"]}
    assert got == sums, (got, sums)
    priced = next(r for r in mine["rows"] if r["profile"] == "openai"
                  and r["model"] == "emu-model#u")
    want = (sums["openai", "emu-model#u"][1] * PRICE_IN
            + sums["openai", "emu-model#u"][2] * PRICE_OUT) / 1e6
    assert priced["spend"] == pytest.approx(want, abs=1e-6), priced
    unpriced = next(r for r in mine["rows"] if r["model"] == "emu-model#h")
    assert unpriced["spend"] == 0, unpriced
    # The admin sees everyone's (its own call's too), and may group.
    with setup.daemon.client() as admin:
        assert admin.run("openai", request_for("openai", "u"))["status"] == "completed"
    every = _usage_json(setup.daemon, "--by", "identity")
    assert {"local", "bob"} <= {r["identity"] for r in every["rows"]}, every
    bob = next(r for r in every["rows"] if r["identity"] == "bob")
    assert bob["input_tokens"] == sum(v[1] for v in sums.values()), bob
    text = _cli(setup.daemon, "usage", "--since", "today", creds=setup.bob)
    assert text.returncode == 0 and "emu-model#u" in text.stdout, text
    # /metrics: the same sums, labelled.
    calls_of_bob = sum(v[0] for v in sums.values())
    samples = _metrics(setup.url, lambda samples: calls_of_bob == sum(
        v for k, v in samples.items()
        if k[0] == "streamfence_usage_calls_total" and ("identity", "bob") in k[1]))
    for (profile, model), (calls, tin, tout) in sums.items():
        labels = (("identity", "bob"), ("model", model), ("provider", profile))
        assert samples["streamfence_usage_calls_total", labels] == calls
        for direction, want_tokens in (("input", tin), ("output", tout)):
            key = ("streamfence_usage_tokens_total",
                   tuple(sorted((*labels, ("direction", direction)))))
            assert samples[key] == want_tokens, (key, samples.get(key))


def _sums_survive_a_restart_and_a_prune(setup: Setup) -> None:
    daemon = setup.daemon
    before = _usage_json(daemon, "--by", "identity", "--by", "profile", "--by", "model")
    daemon.stop()
    newest = daemon.journal_rows("SELECT MAX(finished) FROM calls")[0][0]
    wait_until(lambda: time.time() > newest + 1.05, 5.0, "the last call to be 1 s old")
    pruned = _cli(daemon, "prune", "--older-than", "1s")
    assert pruned.returncode == 0, pruned.stderr
    assert daemon.journal_rows("SELECT COUNT(*) FROM calls") == [(0,)]
    daemon.start()
    after = _usage_json(daemon, "--by", "identity", "--by", "profile", "--by", "model")
    assert after["rows"] == before["rows"], (before, after)
    with Client(credentials=setup.alice, timeout_s=30.0) as client, \
            pytest.raises(ClientError) as refused:  # still over budget
        client.submit("openai", request_for("openai", "u"), subscribe=False)
    assert refused.value.code == "budget_exceeded"
    wait_until(lambda: healthy(setup.url), 30.0, "the gateway to answer again")
    samples = _metrics(setup.url)
    bob = {k: v for k, v in samples.items() if k[0] == "streamfence_usage_calls_total"
           and ("identity", "bob") in k[1]}
    assert sum(bob.values()) == sum(r["calls"] for r in before["rows"]
                                    if r["identity"] == "bob"), bob


def _a_reload_takes_a_new_budget(setup: Setup) -> None:
    daemon = setup.daemon
    text = daemon.config_path.read_text().replace("tokens_per_day = 1000",
                                                  "tokens_per_day = 1000000")
    daemon.config_path.write_text(text)
    assert daemon.proc is not None
    os.kill(daemon.proc.pid, signal.SIGHUP)
    wait_until(lambda: "reload: identities: changed alice (tokens_per_day)"
               in daemon.log_text(), 10.0, "the reload's log line")
    with Client(credentials=setup.alice, timeout_s=30.0) as client:
        done = client.run("openai", request_for("openai", "u"))
    assert done["status"] == "completed", done
