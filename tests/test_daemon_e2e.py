"""End-to-end: the real daemon, real worker processes forked from the warm
zygote, the real sink, the real openai SDK against the real emulator."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
from typing import Any

import psutil
import pytest

from streamfence.devtools.emulator.control import EmulatorClient
from tests.harness import DaemonProcess, wait_until
from tests.wires import WIRES, request_for

pytestmark = pytest.mark.slow


def _collect(client: Any, call_id: str) -> list[dict[str, Any]]:
    return list(client.events(call_id, timeout_s=30.0))


def _content(events: list[dict[str, Any]]) -> str:
    done = events[-1]
    assert done["op"] == "done", events[-1]
    return str(done["response"]["content"])


def test_clean_call_completes_with_exactly_the_emulators_text(
        make_daemon: Any, emu: EmulatorClient) -> None:
    daemon: DaemonProcess = make_daemon()
    with daemon.client() as client:
        call_id = client.submit("emu", request_for("openai", "clean"))
        events = _collect(client, call_id)
    done = events[-1]
    assert done["status"] == "completed", done
    sent = emu.log("clean")
    assert len(sent) == 1
    assert _content(events) == sent[0]["text"]
    assert "".join(e["data"] for e in events if e.get("kind") == "text") == sent[0]["text"]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert done["response"]["finish_reason"] == "stop"
    assert done["response"]["usage"]["total_tokens"] > 0
    # The done event is stored once, in the transcript; `result` and `cancel`
    # of the finished call answer it from there.
    with daemon.client() as client:
        result = client.result(call_id)
        assert client.cancel(call_id)["response"] == done["response"]
    assert result is not None
    assert {k: result[k] for k in done} == done and result["diagnostics"]
    journal = sqlite3.connect(f"file:{daemon.state_dir / 'journal.db'}?mode=ro", uri=True)
    try:
        assert journal.execute("SELECT state, status, done FROM calls WHERE call_id = ?",
                               (call_id,)).fetchall() == [("done", "completed", None)]
    finally:
        journal.close()


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("policy,after", [("continue", 0), ("restart", 3)])
def test_zombie_is_fenced_killed_and_retried(make_daemon: Any, emu: EmulatorClient,
                                             policy: str, after: int, wire: str) -> None:
    """Attempt 1 stalls past the stale timeout, then resumes on the same
    connection. Its worker must be gone, nothing of attempt 1 accepted after
    the fence, and the content exactly one complete response."""
    emu.script("zombie", [{"fault": "stall", "after": after, "stall_s": 3.0}])
    daemon: DaemonProcess = make_daemon(wire=wire)
    with daemon.client() as client:
        call_id = client.submit("emu", request_for(wire, "zombie"),
                                options={"stale_timeout_s": 1.0, "on_partial": policy})
        events = _collect(client, call_id)
    done = events[-1]
    assert done["status"] == "completed", done
    assert done["attempts"] == 2
    sent = emu.log("zombie")
    assert len(sent) == 2
    # Byte for byte: the winning request's text, and nothing of the zombie's.
    assert _content(events).encode() == sent[1]["text"].encode()
    assert sent[0]["text"] != sent[1]["text"]
    # Attempt 1's worker process no longer exists.
    (pid,) = daemon.journal_rows(
        "SELECT worker_pid FROM attempts WHERE call_id = ? AND attempt = 1", call_id)[0:1]
    assert pid[0] and not _alive(pid[0]), f"attempt 1's worker {pid[0]} still exists"
    # The fence: of attempt 1, the transcript holds at most what it sent before the stall.
    rows = daemon.transcript_rows(
        "SELECT attempt, SUM(n) FROM events WHERE call_id = ? AND op = 'delta' "
        "GROUP BY attempt", call_id)
    per_attempt = dict(rows)
    # The journal (result's diagnostics, the console, traces) counts what the sink took of it.
    assert daemon.journal_rows("SELECT deltas FROM attempts WHERE call_id = ? AND attempt = 1",
                               call_id) == [(per_attempt.get(1, 0),)]
    assert per_attempt.get(1, 0) <= after
    assert per_attempt.get(1, 0) <= sent[0]["chunks_sent"]
    if policy == "restart" and per_attempt.get(1, 0):
        assert any(e["op"] == "reset" for e in events)


def _status(pid: int) -> str | None:
    """psutil's status of the process (`stopped`, `sleeping`, ...), None once
    it is gone or a zombie."""
    try:
        status = str(psutil.Process(pid).status())  # psutil: untyped
    except psutil.NoSuchProcess:
        return None
    return None if status == psutil.STATUS_ZOMBIE else status


def _alive(pid: int) -> bool:
    return _status(pid) is not None


def test_kill_9_of_the_worker_retries_with_exactly_one_response(
        make_daemon: Any, emu: EmulatorClient) -> None:
    emu.script("victim", [{"fault": "stall", "after": 0, "stall_s": 20.0}])
    daemon: DaemonProcess = make_daemon()
    with daemon.client() as client:
        call_id = client.submit("emu", request_for("openai", "victim"))
        wait_until(lambda: emu.log("victim"), 10, "the first request to reach the emulator")

        def busy_pid() -> int:
            for w in client.status()["workers"]:
                if w["call_id"] == call_id and w["state"] == "busy":
                    return int(w["pid"])
            return 0

        pid = wait_until(busy_pid, 10, "a busy worker for the call in status")
        os.kill(pid, signal.SIGKILL)
        events = _collect(client, call_id)
    assert events[-1]["status"] == "completed", events[-1]
    sent = emu.log("victim")
    assert len(sent) == 2
    assert _content(events) == sent[1]["text"]
    assert not _alive(pid)


def test_status_shows_workers_with_pid_state_and_attempt(make_daemon: Any,
                                                         emu: EmulatorClient) -> None:
    emu.script("held", [{"fault": "stall", "after": 0, "stall_s": 2.0}])
    daemon: DaemonProcess = make_daemon()
    with daemon.client() as client:
        call_id = client.submit("emu", request_for("openai", "held"))

        def busy() -> dict[str, Any] | None:
            return next((w for w in client.status()["workers"]
                         if w["call_id"] == call_id and w["state"] == "busy"), None)

        worker = wait_until(busy, 10, "the call's worker in status")
        assert worker is not None and worker["attempt"] == 1
        assert psutil.Process(worker["pid"]).is_running()
        status = client.status()
        assert sum(1 for w in status["workers"] if w["state"] == "idle") >= 1
        _collect(client, call_id)


def test_sigkill_of_the_supervisor_leaves_no_child_alive(make_daemon: Any,
                                                         emu: EmulatorClient) -> None:
    emu.script("orphan", [{"fault": "stall", "after": 0, "stall_s": 20.0}])
    daemon: DaemonProcess = make_daemon()
    with daemon.client() as client:
        call_id = client.submit("emu", request_for("openai", "orphan"))
        wait_until(lambda: any(w["call_id"] == call_id and w["state"] == "busy"
                               for w in client.status()["workers"]), 10, "a busy worker")
        roles = client.status()["processes"]
    children = daemon.remember_descendants()
    assert {roles["sink"], roles["zygote"]} <= children
    assert daemon.proc is not None
    daemon.proc.kill()
    daemon.proc.wait(timeout=10)
    procs = []
    for pid in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(pid))
    _, alive = psutil.wait_procs(procs, timeout=1.0)
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"children alive 1 s after SIGKILL of the supervisor: {alive}"


def test_a_worker_killed_while_idle_is_never_handed_an_attempt(
        make_daemon: Any, emu: EmulatorClient) -> None:
    """Regression (found by chaos_workers): a worker SIGKILLed after it
    reported idle, before the zygote reported its exit, was handed an attempt
    and the send to it crashed the supervisor."""
    daemon: DaemonProcess = make_daemon()
    with daemon.client() as client:
        def settled() -> dict[str, Any] | None:
            """A status in which every worker is idle (spares may still be warming
            up when the daemon first reports ready)."""
            status: dict[str, Any] = client.status()
            workers = status["workers"]
            return status if workers and all(w["state"] == "idle" for w in workers) else None

        status = wait_until(settled, 30, "every spare worker to be idle")
        assert status is not None
        zygote = status["processes"]["zygote"]
        idle = [w["pid"] for w in status["workers"]]
        os.kill(zygote, signal.SIGSTOP)  # it can neither reap nor report exits now
        try:
            for pid in idle:
                os.kill(pid, signal.SIGKILL)
            # Exited (a zombie: the stopped zygote cannot reap it), so its
            # sockets are closed; the status round trip lets the supervisor's
            # socket see the disconnect before the submit.
            wait_until(lambda: all(psutil.Process(p).status() == psutil.STATUS_ZOMBIE
                                   for p in idle), 10, "the killed workers to exit")
            client.status()
            call_id = client.submit("emu", request_for("openai", "after-idle-kill"),
                                    options={"first_chunk_timeout_s": 3.0})
            # Either the send fails at once ("unreachable") or, if it raced the
            # disconnect, the first-chunk watchdog fences the attempt.
            wait_until(lambda: any(r.get("call_id") == call_id
                                   and ("unreachable" in r["message"]
                                        or "stale attempt" in r["message"])
                                   for r in daemon.log_records()), 15,
                       "the supervisor to fence the attempt handed to a dead worker")
        finally:
            os.kill(zygote, signal.SIGCONT)
        events = _collect(client, call_id)
        assert daemon.proc is not None and daemon.proc.poll() is None
    assert events[-1]["status"] == "completed", events[-1]
    assert events[-1]["response"]["content"] == emu.log("after-idle-kill")[0]["text"]


def test_a_stale_attempts_worker_is_stopped_at_once_and_killed_once_its_retry_started(
        make_daemon: Any, emu: EmulatorClient) -> None:
    """The failover path (docs/PERFORMANCE.md "Issue 32: the pool"): the stale
    attempt's worker is SIGSTOPped at its fence, so its exit does not take the
    cores the retry starts on, and SIGKILLed once the retry has its first
    chunk. The retry's first chunk waits behind 1.5 s of keep-alives (under
    its 2 s first-chunk budget), and the refill wait is long, so the stopped
    worker is there to be seen."""
    emu.script("stopped", [{"fault": "stall", "after": 3, "stall_s": 30.0},
                           {"fault": "keepalive", "stall_s": 1.5, "chunks": 4}])
    # No back-off: a retry waiting one out is not starting, and the kill comes then.
    daemon: DaemonProcess = make_daemon(daemon={"workers_refill_wait_s": 60.0,
                                                "backoff_base_s": 0.0, "backoff_max_s": 0.0})
    with daemon.client() as client:
        call_id = client.submit("emu", request_for("openai", "stopped"),
                                options={"stale_timeout_s": 2.0, "on_partial": "restart"})
        events = client.events(call_id, timeout_s=30.0)

        def attempt_2_started() -> bool:  # (attempt numbers may skip: ARCHITECTURE §2)
            return len(daemon.journal_rows(
                "SELECT 1 FROM attempts WHERE call_id = ? AND attempt > 1", call_id)) == 1

        wait_until(attempt_2_started, 30, "the stale attempt to be fenced and retried")
        ((pid,),) = daemon.journal_rows(
            "SELECT worker_pid FROM attempts WHERE call_id = ? AND attempt = 1", call_id)
        assert pid, "attempt 1 has no worker pid"
        wait_until(lambda: _status(pid) == psutil.STATUS_STOPPED, 10,
                   f"attempt 1's worker {pid} to be stopped (status {_status(pid)})")
        done = list(events)[-1]
        wait_until(lambda: not _alive(pid), 10,
                   f"attempt 1's worker {pid} to be killed after its retry's first chunk")
    assert done["status"] == "completed" and done["attempts"] == 2, done
    assert len(emu.log("stopped")) == 2


def test_a_stream_silent_after_its_first_chunks_is_stale_within_a_longer_first_chunk_budget(
        make_daemon: Any, emu: EmulatorClient) -> None:
    """`first_chunk_timeout_s` lets a reasoning model think before its first
    token, never go silent afterwards (PROTOCOL §8): attempt 1 sends three
    chunks, then nothing for 8 s, under a 1 s stale timeout and a 60 s
    first-chunk budget. It must be fenced as stale and retried, not waited
    for until the first-chunk budget's end (where it would have resumed and
    completed as one attempt)."""
    emu.script("thinker", [{"fault": "stall", "after": 3, "stall_s": 8.0}, {"fault": "ok"}])
    daemon: DaemonProcess = make_daemon(daemon={"backoff_base_s": 0.0, "backoff_max_s": 0.0})
    with daemon.client() as client:
        call_id = client.submit("emu", request_for("openai", "thinker"),
                                options={"stale_timeout_s": 1.0, "first_chunk_timeout_s": 60.0,
                                         "on_partial": "restart"})
        events = _collect(client, call_id)
        result = client.result(call_id)
    done = events[-1]
    assert result is not None
    assert done["status"] == "completed" and done["attempts"] == 2, (done, result["diagnostics"])
    assert result["diagnostics"][0]["how"] == "stale", result["diagnostics"]
    assert _content(events) == emu.log("thinker")[1]["text"]
