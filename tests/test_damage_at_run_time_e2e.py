"""Issue 29, item 7: damage the start did not read, met by a running daemon,
is a storage fault, never a crash (docs/GUARANTEES.md, "Storage faults").

A real daemon, real CURVE, real SQLite files: with the daemon running, its
file's WAL is checkpointed into it (so every page is in the file, and the
daemon's connection drops its page cache at its next read) and one page of
it is overwritten with other bytes, as `tests/test_storage_damage.py`
damages a stopped daemon's files. The journal's: the supervisor refuses
submits with `storage_error`, keeps answering everything else, says once
which file is damaged and what to do, and never dies; the next start refuses
the file by name. The transcript's, under a finished call: a subscribe to
it gets an error event with `storage_error`, the sink is not restarted, and
every other call is served.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from streamfence.devtools import pages
from streamfence.devtools.emulator.control import EmulatorClient
from streamfence.devtools.launcher import DaemonExited
from streamfence.protocol.client import Client
from streamfence.protocol.client_router import ClientError, Router
from streamfence.protocol.codec import encode
from tests.harness import DaemonProcess

REQUEST = {"messages": [{"role": "user", "content": "x"}]}


def _request(key: str) -> dict[str, Any]:
    return dict(REQUEST, model=f"gpt-emu#{key}")


def _run(client: Client, emu: EmulatorClient, key: str, chunks: int = 3,
         delay_s: float = 0.0) -> str:
    emu.script(key, [{"fault": "ok", "chunks": chunks, "chunk_delay_s": delay_s}])
    call_id = client.submit("emu", _request(key))
    done = client.result(call_id, wait_s=30.0)
    assert done is not None and done["status"] == "completed", done
    return call_id


def _refused(client: Client, key: str) -> ClientError:
    with pytest.raises(ClientError) as refused:
        client.submit("emu", _request(key))
    return refused.value


@pytest.mark.slow
def test_a_damaged_journal_page_refuses_submits_and_the_daemon_serves_on(
        make_daemon: Any, emu: EmulatorClient) -> None:
    daemon: DaemonProcess = make_daemon()
    assert daemon.proc is not None
    supervisor = daemon.proc.pid
    journal = daemon.state_dir / "journal.db"
    with daemon.client(timeout_s=10.0) as client:
        finished = _run(client, emu, "before")
        db = pages.checkpointed(journal)
        try:  # (owner, idempotency_key): every new call's row goes into it; no start read
            page = db.execute("SELECT rootpage FROM sqlite_master WHERE name = "
                              "'sqlite_autoindex_calls_2'").fetchone()[0]
        finally:
            db.close()
        pages.scribble(journal, page)
        for n in range(3):  # the first meets the page; the others are refused before it
            refused = _refused(client, f"after{n}")
            assert refused.code == "storage_error", refused
            assert f"{journal} is damaged (database disk image is malformed)" in \
                refused.message, refused.message
            assert "streamfence check" in refused.message, refused.message
        status = client.status()
        assert status["storage"] is not None and status["storage"]["code"] == "storage_error", \
            status["storage"]
        done = client.result(finished)  # what can be served is
        assert done is not None and done["status"] == "completed", done
        client.subscribe(finished, from_seq=0)
        assert list(client.events(finished, timeout_s=10.0))[-1]["op"] == "done"
        counters = status["counters"]
    assert counters["refused.storage_error"] == 3, counters
    assert [emu.log(f"after{n}") for n in range(3)] == [[], [], []]  # nothing reached it
    assert daemon.proc.poll() is None and daemon.proc.pid == supervisor
    log = daemon.log_text()
    assert "Traceback" not in log, log[-3000:]
    assert log.count(f"{journal} is damaged") == 1, log[-3000:]  # once, not per submit
    assert daemon.stop() == 0, daemon.log_text()[-3000:]
    with pytest.raises(DaemonExited) as start:  # the next start names it
        daemon.start(ready_timeout=10.0)
    assert f"{journal} is damaged" in str(start.value), start.value


def _leaf_of(db: sqlite3.Connection, db_path: Path, only: str, not_: list[str]) -> int:
    """A leaf page of the events table that holds rows of call `only`, none of
    the calls `not_`, and is not the table's last (where new rows go): the
    first such one, so the call's later rows (its done) are elsewhere."""
    leaves = [int(r[0]) for r in db.execute(
        "SELECT pageno FROM dbstat WHERE name = 'events' AND pagetype = 'leaf' ORDER BY path")]
    data = db_path.read_bytes()
    holding = [p for p in leaves[:-1] if only.encode() in data[(p - 1) * pages.PAGE:p * pages.PAGE]]
    assert len(holding) >= 2, f"call {only}'s rows fill {len(holding)} leaf page(s)"
    page = holding[0]
    assert not any(c.encode() in data[(page - 1) * pages.PAGE:page * pages.PAGE] for c in not_)
    return page


@pytest.mark.slow
def test_a_damaged_transcript_page_ends_that_replay_with_an_error_and_no_sink_restart(
        make_daemon: Any, emu: EmulatorClient) -> None:
    daemon: DaemonProcess = make_daemon()
    transcript = daemon.state_dir / "transcript.db"
    with daemon.client(timeout_s=10.0) as client:
        # Paced, so its events are committed in many small rows over several pages.
        damaged = _run(client, emu, "damaged", chunks=300, delay_s=0.005)
        sound = _run(client, emu, "sound")
        db = pages.checkpointed(transcript)
        try:
            page = _leaf_of(db, transcript, damaged, [sound])
        finally:
            db.close()
        pages.scribble(transcript, page)
    with daemon.client(timeout_s=10.0) as client:  # one that never read the call
        client.subscribe(damaged, from_seq=0)
        got: list[dict[str, Any]] = []
        with pytest.raises(ClientError) as ended:
            got.extend(client.events(damaged, timeout_s=20.0))
        assert ended.value.code == "storage_error", ended.value
        assert "transcript is damaged" in ended.value.message, ended.value.message
        assert [e["seq"] for e in got] == list(range(1, len(got) + 1))  # what was sent, in order
        done = client.result(damaged)  # its done event is on another page
        assert done is not None and done["status"] == "completed", done
        client.subscribe(sound, from_seq=0)
        events = list(client.events(sound, timeout_s=20.0))
        assert events[-1]["op"] == "done" and events[-1]["status"] == "completed", events[-1]
        after = _run(client, emu, "after")
        client.subscribe(after, from_seq=0)
        assert list(client.events(after, timeout_s=20.0))[-1]["status"] == "completed"
        status = client.status()
    assert status["counters"].get("sink_restarts", 0) == 0, status["counters"]
    assert status["sink"]["replays_damaged"] == 1, status["sink"]
    log = daemon.log_text()
    assert "Traceback" not in log, log[-3000:]
    assert log.count(f"{transcript} is damaged") == 1, log[-3000:]


def test_the_client_raises_a_replays_error_event_from_events() -> None:
    """The events socket's `error` with a call_id (sink/replays.py) ends that
    call's stream; an `error` without one is still unattributed."""
    router = Router()
    router.route([encode({"v": 1, "op": "delta", "call_id": "c1", "seq": 1, "attempt": 1,
                          "kind": "text", "data": "a"})])
    router.route([encode({"v": 1, "op": "error", "ref": None, "call_id": "c1", "seq": 1,
                          "code": "storage_error", "message": "the transcript is damaged"})])
    assert "c1" in router.woken
    first = router.next_event("c1")
    assert first is not None and first["seq"] == 1
    with pytest.raises(ClientError) as raised:
        router.next_event("c1")
    assert raised.value.code == "storage_error"
    assert "replay of call c1: the transcript is damaged" in str(raised.value)
