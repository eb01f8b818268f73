"""Crash loops back off instead of giving up (docs/ARCHITECTURE.md §4.14), on
the real daemon: a sink SIGKILLed from outside again and again is restarted
with growing delays while the daemon keeps answering, a call waits for a
killed zygote's successor, and a sink that cannot start at all still stops
the daemon, with the reason."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

from streamfence.devtools.emulator.control import EmulatorClient
from streamfence.protocol.client import Client
from tests.harness import DaemonProcess, wait_until
from tests.wires import request_for

SINK_KILLS = 6  # more than the 5 deaths a minute that used to stop the daemon
STATUS_WITHIN_S = 2.0  # a status answered while a child is down: no waiting on it
RESTART_LINE = re.compile(r"^the (sink|zygote) exited with .*; restarting it in ([0-9.]+)s")


def _restart_delays(daemon: DaemonProcess, child: str) -> list[float]:
    delays = []
    for record in daemon.log_records():
        match = RESTART_LINE.match(record.get("message", ""))
        if match and match.group(1) == child:
            assert record["level"] == "ERROR", record
            delays.append(float(match.group(2)))
    return delays


def _sink_serves(daemon: DaemonProcess, pid: int) -> bool:
    """The sink with this pid said it serves (its own log line, shipped to the daemon's)."""
    return any(r.get("message", "").startswith(f"sink: serving pid={pid} ")
               for r in daemon.log_records())


class Watch:
    """Status requests, each timed: a slow answer fails the test, and so does
    the daemon's exit (with its log's tail)."""

    def __init__(self, daemon: DaemonProcess, client: Client) -> None:
        self.daemon = daemon
        self.client = client
        self.answered_down = 0  # answers that showed the child down

    def pid(self, child: str) -> int | None:
        started = time.monotonic()
        try:
            status = self.client.status()
        except TimeoutError:
            assert self.daemon.proc is not None
            if self.daemon.proc.poll() is not None:
                pytest.fail(f"the daemon exited with {self.daemon.proc.returncode}:\n"
                            + self.daemon.log_text()[-3000:])
            raise
        took = time.monotonic() - started
        assert took < STATUS_WITHIN_S, f"status took {took:.2f}s"
        pid: int | None = status["processes"][child]
        self.answered_down += pid is None
        return pid

    def new_pid(self, child: str, old: int, what: str) -> int:
        def changed() -> int | None:
            pid = self.pid(child)
            return pid if pid not in (None, old) else None

        pid = wait_until(changed, 30.0, what)
        assert pid is not None
        return pid


@pytest.mark.slow
def test_a_sink_killed_again_and_again_backs_off_and_the_daemon_serves(
        make_daemon: Any, emu: EmulatorClient) -> None:
    daemon: DaemonProcess = make_daemon()
    with daemon.client(timeout_s=10.0) as client:
        watch = Watch(daemon, client)
        pid = watch.pid("sink")
        assert pid is not None
        waited = []
        for kill in range(1, SINK_KILLS + 1):
            wait_until(functools.partial(_sink_serves, daemon, pid), 30.0,
                       f"sink {pid} to serve before kill {kill}")
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            pid = watch.new_pid("sink", pid, f"the sink's restart after kill {kill}")
            waited.append(time.monotonic() - killed_at)
        assert daemon.proc is not None and daemon.proc.poll() is None, daemon.log_text()[-3000:]
        status = client.status()
        assert status["counters"]["sink_restarts"] == SINK_KILLS
        assert watch.answered_down > 0, "no status answered while the sink was down"
        # Each restart logged once, with a delay that doubles; none came sooner.
        delays = _restart_delays(daemon, "sink")
        assert delays == [0.1 * 2 ** i for i in range(SINK_KILLS)], delays
        for kill, (took, delay) in enumerate(zip(waited, delays, strict=True), 1):
            assert took >= delay, f"kill {kill}: restarted after {took:.2f}s, before {delay}s"
        assert not any(r["level"] == "CRITICAL" for r in daemon.log_records())
        after = client.run("emu", request_for("openai", "after-storm"), timeout_s=30.0)
    assert after["status"] == "completed", after


@pytest.mark.slow
def test_a_call_submitted_while_the_zygote_is_down_runs_on_the_next_one(
        make_daemon: Any, emu: EmulatorClient) -> None:
    """Its worker's fork request waits for the restarted zygote (the policy's
    growing delays are tests/test_restarts.py's: a zygote restart costs seconds
    of SDK imports here)."""
    daemon: DaemonProcess = make_daemon()
    with daemon.client(timeout_s=10.0) as client:
        watch = Watch(daemon, client)
        first = watch.pid("zygote")
        assert first is not None
        os.kill(first, signal.SIGKILL)
        call_id = client.submit("emu", request_for("openai", "during-zygote-restart"))
        watch.new_pid("zygote", first, "the zygote's restart")
        done = client.result(call_id, wait_s=30.0)
        assert done is not None and done["status"] == "completed", done
        assert client.status()["counters"]["zygote_restarts"] == 1
    assert _restart_delays(daemon, "zygote") == [0.1]


def _endpoint_with_events_port_taken() -> tuple[str, socket.socket]:
    """A free port P for the client endpoint, and a socket bound to P + 1, where
    the sink would bind the events endpoint (bound, not listening: a client's
    connection to it is refused at once rather than left unanswered)."""
    for _ in range(50):
        held = socket.socket()
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1] - 1
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                held.close()
                continue
        return f"tcp://127.0.0.1:{port}", held
    pytest.fail("no free pair of adjacent ports on 127.0.0.1")


def test_a_sink_that_cannot_bind_stops_the_daemon_with_the_reason(make_daemon: Any) -> None:
    endpoint, held = _endpoint_with_events_port_taken()
    events = f"tcp://127.0.0.1:{held.getsockname()[1]}"
    daemon: DaemonProcess = make_daemon(daemon={"endpoint": endpoint}, start=False)
    with held:
        # Run to its end (a daemon that went on serving is killed by the timeout).
        proc = subprocess.run([sys.executable, "-m", "streamfence.cli", "serve", "--config",
                               str(daemon.config_path), "--log-json"],
                              capture_output=True, text=True, timeout=60.0,
                              stdin=subprocess.DEVNULL)
    assert proc.returncode == 1, proc.stderr[-3000:]
    records = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    critical = [r["message"] for r in records if r["level"] == "CRITICAL"]
    assert critical == [f"the sink cannot start: the events endpoint {events} cannot be bound "
                        f"(the client endpoint's port + 1, or its path + '.events': "
                        f"docs/PROTOCOL.md §1); stopping (the journal keeps every accepted "
                        f"call for the next start)"], proc.stderr[-3000:]
    assert not any(RESTART_LINE.match(r["message"]) for r in records)  # never restarted
