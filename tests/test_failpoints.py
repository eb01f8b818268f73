"""The failpoints themselves (protocol/failpoints.py): the spec's grammar,
each action in a real process, `@N`, once per daemon with a directory, the
record of passes; and that ARCHITECTURE §7 lists exactly the points the
code places."""

from __future__ import annotations

import ast
import http.client
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess
from streamfence.devtools.nats_cluster import NatsCluster
from streamfence.gateway.keys import http_key
from streamfence.protocol import failpoints
from streamfence.protocol.credentials import load_credentials
from streamfence.protocol.failpoints import CLUSTER_POINTS, POINTS, Action, parse
from tests.harness import DaemonProcess, assert_one_exact_answer, free_port, healthy, wait_until
from tests.wires import profile_for, request_for

ROOT = Path(__file__).resolve().parent.parent
SOME_POINT = "sink.after_commit"


def test_a_spec_parses_into_actions() -> None:
    armed = parse(f"{SOME_POINT}=crash; worker.before_final=pause(800ms)@2;"
                  "gateway.replay_to_live=pause(1.5s);*=count")
    assert armed == {SOME_POINT: Action("crash"),
                     "worker.before_final": Action("pause", 0.8, 2),
                     "gateway.replay_to_live": Action("pause", 1.5),
                     "*": Action("count")}
    assert parse("") == {}


@pytest.mark.parametrize("spec, says", [
    ("nowhere.at_all=crash", "'nowhere.at_all' is no failpoint"),
    (f"{SOME_POINT}=explode", "is not NAME=ACTION"),
    (f"{SOME_POINT}=pause", "pause takes a time"),
    (f"{SOME_POINT}=crash(5ms)", "pause takes a time"),
    (f"{SOME_POINT}=crash@0", "@N counts from 1"),
    (f"{SOME_POINT}", "is not NAME=ACTION"),
])
def test_a_bad_spec_is_refused_naming_the_entry(spec: str, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        parse(spec)


def _pass_through(spec: str, times: int, where: Path | None = None) -> subprocess.CompletedProcess[str]:
    """A process armed with `spec` passes SOME_POINT `times` times, printing
    what each pass returned."""
    code = ("from streamfence.protocol.failpoints import ARMED, failpoint\n"
            f"for i in range({times}):\n"
            f"    print(i, bool(ARMED) and failpoint({SOME_POINT!r}), flush=True)\n")
    env = dict(os.environ, STREAMFENCE_FAILPOINTS=spec)
    env.pop("STREAMFENCE_FAILPOINTS_DIR", None)
    if where is not None:
        env["STREAMFENCE_FAILPOINTS_DIR"] = str(where)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=30)


def test_crash_kills_the_process_at_the_armed_pass() -> None:
    proc = _pass_through(f"{SOME_POINT}=crash@3", 5)
    assert proc.returncode == -signal.SIGKILL
    assert proc.stdout.split("\n")[:2] == ["0 False", "1 False"]
    assert "2 " not in proc.stdout


def test_drop_is_answered_once_raise_raises_and_pause_returns() -> None:
    assert _pass_through(f"{SOME_POINT}=drop@2", 3).stdout.split() == \
        ["0", "False", "1", "True", "2", "False"]
    raised = _pass_through(f"{SOME_POINT}=raise", 2)
    assert raised.returncode == 1 and "FailpointError: failpoint sink.after_commit" in raised.stderr
    paused = _pass_through(f"{SOME_POINT}=pause(10ms)", 2)
    assert paused.returncode == 0 and paused.stdout.split() == ["0", "False", "1", "False"]


def test_disarmed_no_point_acts_and_nothing_is_recorded(tmp_path: Path) -> None:
    proc = _pass_through("", 3, where=tmp_path)
    assert proc.returncode == 0
    assert failpoints.hits(str(tmp_path)) == []


def test_with_a_directory_an_action_fires_once_for_all_processes(tmp_path: Path) -> None:
    """A restarted process passes the point again but does not fire: a sink
    armed to crash after a commit crashes once, not at every restart."""
    first = _pass_through(f"{SOME_POINT}=crash", 2, where=tmp_path)
    second = _pass_through(f"{SOME_POINT}=crash", 2, where=tmp_path)
    assert first.returncode == -signal.SIGKILL
    assert second.returncode == 0
    assert failpoints.hits(str(tmp_path)) == [SOME_POINT] * 3


def test_a_wildcard_count_records_every_pass(tmp_path: Path) -> None:
    proc = _pass_through("*=count", 2, where=tmp_path)
    assert proc.returncode == 0 and proc.stdout.split()[1::2] == ["False", "False"]
    assert failpoints.hits(str(tmp_path)) == [SOME_POINT] * 2


# ---- the list in ARCHITECTURE and the places in the code --------------------------------

def _placed() -> dict[str, list[str]]:
    """Point name -> the files that pass through it (`failpoint("name")`)."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "streamfence").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "failpoint" \
                    and node.args and isinstance(node.args[0], ast.Constant):
                found.setdefault(str(node.args[0].value), []).append(
                    str(path.relative_to(ROOT)))
    return found


def test_architecture_lists_exactly_the_points() -> None:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## 7.", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `([a-z]+\.[a-z_]+)` \| (.*) \|$", section, re.M))
    listed = set(rows)
    assert listed == set(POINTS), (f"only in ARCHITECTURE §7: {sorted(listed - set(POINTS))}; "
                                   f"only in POINTS: {sorted(set(POINTS) - listed)}")
    differ = {name: (rows[name], step) for name, step in POINTS.items() if rows[name] != step}
    assert not differ, f"ARCHITECTURE §7 and POINTS say different steps: {differ}"


def test_every_point_is_placed_once_and_every_placed_point_is_known() -> None:
    placed = _placed()
    assert set(placed) <= set(POINTS), f"unknown points placed: {set(placed) - set(POINTS)}"
    missing = sorted(set(POINTS) - set(placed))
    assert not missing, f"points no code passes through: {missing}"
    twice = {n: files for n, files in placed.items() if len(files) > 1}
    assert not twice, f"points placed more than once: {twice}"


# ---- armed in a real daemon ---------------------------------------------------------------

Armed = Callable[..., tuple[DaemonProcess, Path]]


@pytest.fixture
def armed(tmp_path: Path, emulator: EmulatorProcess) -> Iterator[Armed]:
    """`armed(spec, **DaemonProcess kwargs)`: a started daemon against the
    emulator whose processes all start with STREAMFENCE_FAILPOINTS=spec and a
    directory for the record of passes (returned with it)."""
    started: list[DaemonProcess] = []

    def start(spec: str, **kwargs: Any) -> tuple[DaemonProcess, Path]:
        where = tmp_path / "failpoints"
        where.mkdir()
        proc = DaemonProcess(tmp_path / "state", {"emu": profile_for("openai", emulator)},
                             env={failpoints.ENV: spec, failpoints.DIR_ENV: str(where)}, **kwargs)
        started.append(proc)
        return proc.start(), where

    yield start
    for proc in started:
        proc.cleanup()
        assert not proc.survivors, f"processes outlived the daemon: {proc.survivors}"


def _sse_ids(url: str, key: str, headers: dict[str, str], limit: int | None = None) -> list[int]:
    """The event ids of a streaming chat completion through the gateway, up
    to `limit` of them (then the connection is dropped) or the stream's end."""
    conn = http.client.HTTPConnection(url, timeout=30.0)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps({
            "model": f"emu/gpt-emu#{key}", "stream": True,
            "messages": [{"role": "user", "content": "hello"}]}), headers)
        reply = conn.getresponse()
        assert reply.status == 200, reply.read()
        ids: list[int] = []
        for line in iter(reply.readline, b""):
            if line.startswith(b"id: "):
                ids.append(int(line[4:]))
                if len(ids) == limit:
                    break
        reply.close()  # it holds the socket too: closed here, not by the garbage collector
        return ids
    finally:
        conn.close()


@pytest.mark.slow
def test_every_point_is_reached_by_a_daemons_ordinary_faults(armed: Armed,
                                                             emu: EmulatorClient) -> None:
    """Armed `*=count`, a daemon with its gateway runs a plain call, a stalled
    one (fenced, its worker killed, retried), one whose sink is killed
    mid-stream (rebound), and an HTTP stream resumed with Last-Event-ID:
    together they pass every point of POINTS but those of cluster mode
    (CLUSTER_POINTS: the next test's)."""
    port = free_port()
    daemon, where = armed("*=count", tables={"http": {"listen": f"127.0.0.1:{port}"}})
    emu.script("plain", [{"fault": "ok", "chunks": 5}])
    emu.script("stalled", [{"fault": "stall", "after": 0, "stall_s": 4.0}, {"fault": "ok"}])
    emu.script("rebound", [{"fault": "ok", "chunks": 40, "chunk_delay_s": 0.05}])
    emu.script("resumed", [{"fault": "ok", "chunks": 20, "chunk_delay_s": 0.05}])
    with daemon.client(timeout_s=20.0) as client:
        assert client.run("emu", request_for("openai", "plain"), timeout_s=30.0)["status"] \
            == "completed"
        stalled = client.run("emu", request_for("openai", "stalled"), timeout_s=30.0,
                             options={"stale_timeout_s": 1.0})
        assert stalled["status"] == "completed" and stalled["attempts"] == 2, stalled
        call_id = client.submit("emu", request_for("openai", "rebound"))
        events = list(itertools.islice(client.events(call_id, timeout_s=20.0), 5))
        os.kill(client.status()["processes"]["sink"], signal.SIGKILL)
        events += list(client.events(call_id, timeout_s=20.0))
        assert events[-1]["status"] == "completed"
        assert client.status()["counters"]["attempts_rebound"] == 1
    url = f"127.0.0.1:{port}"
    wait_until(lambda: healthy("http://" + url), 30.0, "the gateway to answer")
    headers = {"Authorization": f"Bearer {http_key(load_credentials(daemon.credentials_path))}",
               "Content-Type": "application/json", "Idempotency-Key": "resumed-1"}
    first = _sse_ids(url, "resumed", headers, limit=3)
    rest = _sse_ids(url, "resumed", dict(headers, **{"Last-Event-ID": str(first[-1])}))
    assert rest and min(rest) > first[-1], (first, rest[:3])
    reached = set(failpoints.hits(str(where)))
    never = sorted(set(POINTS) - set(CLUSTER_POINTS) - reached)
    assert not never, f"points no test passes through: {never}"
    assert reached == set(POINTS) - set(CLUSTER_POINTS)


@pytest.mark.slow
def test_every_cluster_point_is_reached_by_a_cluster_daemons_call(
        armed: Armed, emu: EmulatorClient, nats: NatsCluster) -> None:
    """The points only cluster mode passes: armed `*=count`, a host on a real
    3-node NATS cluster runs one call, whose attempt takes the call's owner
    entry and opens its epoch in the call's log. With the test above, every
    point of POINTS is reached."""
    assert CLUSTER_POINTS and set(CLUSTER_POINTS) <= set(POINTS)
    daemon, where = armed("*=count", tables={"cluster": {"urls": nats.urls, "host": "host-a",
                                                         "replicas": 3}})
    emu.script("clustered", [{"fault": "ok", "chunks": 5}])
    with daemon.client(timeout_s=20.0) as client:
        assert client.run("emu", request_for("openai", "clustered"), timeout_s=30.0)["status"] \
            == "completed"
    reached = set(failpoints.hits(str(where)))
    never = sorted(set(CLUSTER_POINTS) - reached)
    assert not never, f"cluster points no test passes through: {never}"


@pytest.mark.slow
def test_a_sink_crash_after_a_commit_costs_no_answer(armed: Armed, emu: EmulatorClient) -> None:
    """`crash` in a real daemon: the sink kills itself once after a commit,
    before the events it stored go out (its 3rd with events for a listener:
    mid-stream), is restarted, the attempt is rebound, and the call
    completes exactly from its one provider request."""
    daemon, where = armed("sink.after_commit=crash@3")
    emu.script("crashed", [{"fault": "ok", "chunks": 30, "chunk_delay_s": 0.03}])
    with daemon.client(timeout_s=20.0) as client:
        call_id = client.submit("emu", request_for("openai", "crashed"))
        events = list(client.events(call_id, timeout_s=20.0))
        status = client.status()
    assert_one_exact_answer(events, emu.log("crashed"))
    assert status["counters"]["sink_restarts"] == 1
    assert status["counters"]["attempts_rebound"] == 1  # it crashed mid-stream
    assert (where / "fired.sink.after_commit").exists()
    # Passed on commits with a listener's events only: how many more after the
    # restart depends on when the listener is back, so no count past the crash's.
    assert failpoints.hits(str(where)).count("sink.after_commit") >= 3


@pytest.mark.slow
def test_a_dropped_final_ack_costs_no_answer(armed: Armed, emu: EmulatorClient) -> None:
    """`drop` in a real daemon: the sink accepts the final but its ack to the
    worker is lost. The supervisor heard E_ENDED all the same: the call
    completes from its one request, and the daemon serves the next call."""
    daemon, where = armed("sink.before_final_ack=drop")
    emu.script("unacked", [{"fault": "ok", "chunks": 5}])
    emu.script("next", [{"fault": "ok", "chunks": 5}])
    with daemon.client(timeout_s=20.0) as client:
        call_id = client.submit("emu", request_for("openai", "unacked"))
        events = list(client.events(call_id, timeout_s=20.0))
        after = client.run("emu", request_for("openai", "next"), timeout_s=30.0)
    assert_one_exact_answer(events, emu.log("unacked"))
    assert after["status"] == "completed"
    # Its worker still waits for the ack (it logs the attempt's end once acked).
    assert not any(r.get("call_id") == call_id and "attempt ended" in r.get("message", "")
                   for r in daemon.log_records())
    assert failpoints.hits(str(where)).count("sink.before_final_ack") == 2
    assert (where / "fired.sink.before_final_ack").exists()


@pytest.mark.slow
def test_a_paused_worker_before_its_final_costs_no_answer(armed: Armed,
                                                         emu: EmulatorClient) -> None:
    """`pause` in a real daemon: the worker stands still 800 ms between the
    provider's end and its final; the call waits for it and completes."""
    daemon, where = armed("worker.before_final=pause(800ms)")
    emu.script("paused", [{"fault": "ok", "chunks": 5}])
    with daemon.client(timeout_s=20.0) as client:
        started = time.monotonic()
        call_id = client.submit("emu", request_for("openai", "paused"))
        events = list(client.events(call_id, timeout_s=20.0))
        took = time.monotonic() - started
    assert_one_exact_answer(events, emu.log("paused"))
    assert took >= 0.8
    assert failpoints.hits(str(where)) == ["worker.before_final"]


@pytest.mark.slow
def test_the_deltas_a_fence_refused_are_journaled_with_their_attempt(
        armed: Armed, emu: EmulatorClient) -> None:
    """`supervisor.after_fence=pause`: a cancelled attempt's worker streams on
    between its fence and its kill; the sink refuses those deltas, and the
    journal (result's diagnostics, the console, traces) says how many."""
    daemon, _ = armed("supervisor.after_fence=pause(600ms)")
    emu.script("refused", [{"fault": "ok", "chunks": 400, "chunk_delay_s": 0.005}])
    with daemon.client(timeout_s=20.0) as client:
        call_id = client.submit("emu", request_for("openai", "refused"))
        events = iter(client.events(call_id, timeout_s=20.0))
        assert all(next(events)["op"] == "delta" for _ in range(3))
        client.cancel(call_id)
        done = client.result(call_id, wait_s=20.0)
        assert done is not None and done["status"] == "cancelled", done
        (row,) = done["diagnostics"]
    sent = emu.wait_for(lambda log: log[0] if log and log[0]["ended"] else None,
                        timeout=15.0, what="the attempt's connection to close", key="refused")
    stored = daemon.transcript_rows("SELECT SUM(n) FROM events WHERE call_id = ? AND "
                                    "op = 'delta'", call_id)[0][0]
    assert row["refused"] and row["refused"] > 0, row  # ~120 at 5 ms a chunk for 600 ms
    assert row["deltas"] == stored, (row, stored)  # what the sink took, and only that
    assert row["deltas"] + row["refused"] <= sent["chunks_sent"], (row, sent)
