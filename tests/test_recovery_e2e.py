"""Stopping and restarting the daemon: a graceful stop lets running attempts
finish; after kill -9 of the whole daemon, accepted unfinished calls resume
from the journal under a new epoch and complete with exactly one answer."""

from __future__ import annotations

import signal
import sqlite3
from typing import Any

import pytest

from streamfence.devtools.emulator.control import EmulatorClient
from streamfence.devtools.emulator.state import messages_digest
from streamfence.supervisor.journal import FILE_BYTES
from tests.harness import DaemonProcess, wait_until
from tests.wires import request_for

pytestmark = pytest.mark.slow


def _kill_9(daemon: DaemonProcess) -> None:
    """kill -9 of the supervisor; what is left of its tree reaped (nothing should be)."""
    daemon.kill()  # remembers the tree first, so that `stop` finds what is left
    daemon.stop()


def _restarted(make_daemon: Any) -> DaemonProcess:
    again: DaemonProcess = make_daemon(start=False)  # same state dir
    again.start()
    return again


def test_sigterm_lets_the_running_attempt_finish_and_exits_0(make_daemon: Any,
                                                             emu: EmulatorClient) -> None:
    emu.script("graceful", [{"fault": "ok", "chunks": 30, "chunk_delay_s": 0.05}])
    daemon: DaemonProcess = make_daemon(daemon={"stop_grace_s": 30.0})  # the default drain
    with daemon.client() as client:
        call_id = client.submit("emu", request_for("openai", "graceful"))
        wait_until(lambda: any(r["chunks_sent"] >= 3 for r in emu.log("graceful")), 10,
                   "the stream to be under way")
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGTERM)
        events = list(client.events(call_id, timeout_s=20.0))
    assert events[-1]["status"] == "completed", events[-1]
    assert events[-1]["response"]["content"] == emu.log("graceful")[0]["text"]
    assert daemon.proc.wait(timeout=20) == 0


def test_kill_9_of_the_daemon_then_restart_resumes_the_call(make_daemon: Any,
                                                            emu: EmulatorClient) -> None:
    emu.script("survivor", [{"fault": "stall", "after": 2, "stall_s": 30.0}])
    daemon: DaemonProcess = make_daemon()
    with daemon.client() as client:
        call_id = client.submit("emu", request_for("openai", "survivor"),
                                options={"on_partial": "restart"})
        seen = []
        for event in client.events(call_id, timeout_s=10.0):
            seen.append(event)
            if len(seen) == 2:
                break
    _kill_9(daemon)
    again = _restarted(make_daemon)
    with again.client() as client:
        client.subscribe(call_id, from_seq=seen[-1]["seq"])
        rest = list(client.events(call_id, timeout_s=30.0))
    done = rest[-1]
    assert done["status"] == "completed", done
    sent = emu.log("survivor")
    assert len(sent) == 2
    assert done["response"]["content"] == sent[1]["text"]
    assert any(e["op"] == "reset" for e in rest), rest
    attempts = {e["attempt"] for e in rest if e["op"] == "delta"}
    assert attempts and min(attempts) > 1  # a new epoch, never a reused attempt number
    assert [e["seq"] for e in seen + rest] == list(range(1, len(seen) + len(rest) + 1))


def test_a_restart_never_reuses_an_epoch_only_the_sink_stored(make_daemon: Any,
                                                             emu: EmulatorClient) -> None:
    """A retry's epoch is journaled while the sink authorizes it
    (docs/ARCHITECTURE.md §2.2): a power cut can leave the transcript one
    epoch ahead of the journal. Made here by hand after a kill -9: the
    restart starts above the sink's epoch, and the call completes (were
    the journal's epoch reused, the sink would refuse it and the call fail)."""
    emu.script("ahead", [{"fault": "stall", "after": 2, "stall_s": 30.0}])
    daemon: DaemonProcess = make_daemon()
    with daemon.client() as client:
        call_id = client.submit("emu", request_for("openai", "ahead"),
                                options={"on_partial": "restart"})
        wait_until(lambda: any(r["chunks_sent"] >= 2 for r in emu.log("ahead")), 10,
                   "the first attempt to be streaming")
    _kill_9(daemon)
    with sqlite3.connect(daemon.state_dir / "transcript.db") as db:
        db.execute("UPDATE calls SET max_epoch = max_epoch + 1 WHERE call_id = ?", (call_id,))
        (ahead,), = db.execute("SELECT max_epoch FROM calls WHERE call_id = ?", (call_id,))
    assert ahead == 2
    again = _restarted(make_daemon)
    with again.client() as client:
        client.subscribe(call_id, from_seq=0)
        rest = list(client.events(call_id, timeout_s=30.0))
    done = rest[-1]
    assert done["status"] == "completed", done
    assert done["response"]["content"] == emu.log("ahead")[1]["text"]
    assert {e["attempt"] for e in rest if e["op"] == "delta" and e["seq"] > 2} == {3}


def test_a_large_request_survives_kill_9_in_its_file(make_daemon: Any,
                                                     emu: EmulatorClient) -> None:
    """A request of FILE_BYTES or more is journaled as a file (off the loop):
    accepted means that file is durable, a restart runs the call again with
    the same request, and the file goes when the call is done."""
    emu.script("large", [{"fault": "stall", "after": 2, "stall_s": 30.0}])
    request = {"model": "gpt-emu#large",
               "messages": [{"role": "user", "content": "y" * FILE_BYTES}]}
    daemon: DaemonProcess = make_daemon()
    files = daemon.state_dir / "requests"
    with daemon.client() as client:
        call_id = client.submit("emu", request)
        assert [p.name for p in files.iterdir()] == [call_id]
        wait_until(lambda: any(r["chunks_sent"] >= 2 for r in emu.log("large")), 10,
                   "the first attempt to be streaming")
    _kill_9(daemon)
    again = _restarted(make_daemon)
    with again.client() as client:
        client.subscribe(call_id, from_seq=0)
        done = list(client.events(call_id, timeout_s=30.0))[-1]
    assert done["status"] == "completed", done
    first, second = emu.log("large")
    assert first["request"]["messages_sha256"] == messages_digest(request["messages"])
    assert second["request"]["messages_sha256"] == messages_digest(request["messages"])
    wait_until(lambda: not any(files.iterdir()), 10, "the done call's request file to go")
