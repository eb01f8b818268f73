"""An admin's `status` does not wait on a sink that does not answer
(supervisor/sinklink.py, status.py): after STATS_WAIT_S it answers with the
sink's last counters known and `sink_answered: false`; the late answer is
kept for the next one. The link on real ZeroMQ sockets with a fake clock,
and the real daemon with its sink stopped (SIGSTOP)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from streamfence.protocol.internal.control import Stats, encode_ok, parse_control
from streamfence.supervisor.sinklink import STATS_WAIT_S, SinkLink
from tests.harness import DaemonProcess, process_state, wait_until
from tests.wires import DaemonFactory


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _pair(tmp_path: Path) -> tuple[zmq.Context[Any], zmq.Socket[bytes], zmq.Socket[bytes]]:
    ctx: zmq.Context[Any] = zmq.Context()
    sink = ctx.socket(zmq.ROUTER)
    sink.linger = 0
    sink.bind(f"ipc://{tmp_path}/ctl")
    sup = ctx.socket(zmq.DEALER)
    sup.linger = 0
    sup.connect(f"ipc://{tmp_path}/ctl")
    return ctx, sink, sup


def _received(sink: zmq.Socket[bytes]) -> tuple[bytes, Any]:
    assert sink.poll(5000), "the stats request did not reach the sink's socket"
    identity, frame = sink.recv_multipart()
    return identity, parse_control(msgpack.unpackb(frame, raw=False))


def _drained(link: SinkLink) -> None:
    wait_until(lambda: link.socket.poll(0) and link.drain(_NoAttempts()), 5.0, "the sink's reply")


class _NoAttempts:
    def on_ended(self, ended: Any) -> None: raise AssertionError(ended)
    def on_final_refused(self, refused: Any) -> None: raise AssertionError(refused)
    def on_lost(self, lost: Any) -> None: raise AssertionError(lost)
    def on_followed_done(self, done: Any) -> None: raise AssertionError(done)


def test_a_late_sink_gets_the_last_counters_once_and_its_answer_is_kept(tmp_path: Path) -> None:
    ctx, sink, sup = _pair(tmp_path)
    clock = Clock()
    link = SinkLink(sup, clock)
    answers: list[tuple[dict[str, Any], bool]] = []
    try:
        link.read_stats(lambda stats, fresh: answers.append((dict(stats), fresh)), 1.0)
        identity, first = _received(sink)
        assert isinstance(first, Stats)
        sink.send_multipart([identity, encode_ok(first.req, {"deltas": 1})])
        _drained(link)
        assert answers == [({"deltas": 1}, True)]  # in time: the sink's own
        assert link.next_due() is None

        link.read_stats(lambda stats, fresh: answers.append((dict(stats), fresh)), 1.0)
        identity, second = _received(sink)
        assert link.next_due() == clock.now + 1.0
        clock.now += 0.5
        link.expire(clock.now)
        assert len(answers) == 1  # still waiting
        clock.now += 0.5
        link.expire(clock.now)
        assert answers[1] == ({"deltas": 1}, False)  # the last known, marked so
        sink.send_multipart([identity, encode_ok(second.req, {"deltas": 7})])
        _drained(link)
        assert len(answers) == 2 and link.stats == {"deltas": 7}  # kept, not answered twice
    finally:
        sink.close()
        sup.close()
        ctx.term()


@pytest.fixture(scope="module")
def daemon(module_daemon: DaemonFactory) -> DaemonProcess:
    return module_daemon()


@pytest.mark.slow
def test_status_answers_while_the_sink_is_stopped(daemon: DaemonProcess) -> None:
    with daemon.client(timeout_s=5.0) as client:
        before = client.status()
        assert before["sink_answered"] is True and before["sink"], before
        sink_pid = before["processes"]["sink"]
        os.kill(sink_pid, signal.SIGSTOP)
        try:
            wait_until(lambda: process_state(sink_pid) == "T", 5.0, "the sink to stop")
            started = time.monotonic()
            stopped = client.status()
            took = time.monotonic() - started
        finally:
            os.kill(sink_pid, signal.SIGCONT)
        assert stopped["sink_answered"] is False, stopped
        assert took < STATS_WAIT_S + 1.0, f"status took {took:.2f} s with the sink stopped"
        assert stopped["sink"].keys() == before["sink"].keys()
        assert stopped["processes"]["sink"] == sink_pid  # not restarted: only slow
        after = wait_until(lambda: (s := client.status())["sink_answered"] and s, 10.0,
                           "the sink to answer again")
        assert after["processes"]["sink"] == sink_pid
