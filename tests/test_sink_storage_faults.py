"""Issue 13, items 1 and 2 (the transcript side): a storage fault at the
sink's writes (a full disk, here a real tmpfs filled to ENOSPC) is waited
out, never a crash, never a lost row, never "cannot rollback - no
transaction is active" over the real error; a stop asked meanwhile gives
the write up at once; damage stays fatal. Then the real sink process: it
answers C_STATS with the fault while it waits, holds every other control op
until its commit, and exits promptly on SIGTERM. The last test does it to a
running daemon: the call completes from its one provider request and the
sink is never restarted."""

from __future__ import annotations

import logging
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from streamfence.devtools import disks
from streamfence.devtools.emulator.control import EmulatorClient
from streamfence.protocol.codec import encode
from streamfence.protocol.internal import C_AUTHORIZE, C_STATS, R_OK, R_REFUSED
from streamfence.protocol.internal.control import Stats
from streamfence.protocol.sqlite_faults import is_storage_fault
from streamfence.sink.process import run_sink
from streamfence.sink.state import SinkState
from streamfence.sink.store import StoreStopped, TranscriptStore
from tests.fakes import Nobody
from tests.harness import DaemonProcess, assert_one_exact_answer, wait_until
from tests.test_sink_process import MP, START_S, SinkUnderTest, Supervisor, delta

BAD_ROLLBACK = "no transaction is active"


# ---- a small real disk ------------------------------------------------------------


def buffer_runs(store: TranscriptStore, calls: int, events: int = 3) -> dict[str, bytes]:
    """One run of `events` deltas of 700 bytes for each of `calls` calls (not
    committed); returns each call's stored body."""
    bodies = {}
    for i in range(calls):
        call = f"c{i:03d}"
        run = [bytes([65 + (i + k) % 26]) * 700 for k in range(events)]
        store.add_run(call, 1, 1, run)
        bodies[call] = b"".join(run)
    return bodies


def stored_bodies(path: Path) -> dict[str, bytes]:
    """The events' bodies per call, read back by a connection of its own."""
    conn = sqlite3.connect(path)
    try:
        return {c: bytes(b) for c, b in conn.execute("SELECT call_id, body FROM events")}
    finally:
        conn.close()


class InThread:
    """Run `fn` on a thread; `join` returns its result or raises its exception."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._result: list[Any] = []
        self._error: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._result.append(fn())
        except BaseException as exc:
            self._error.append(exc)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float, what: str) -> Any:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"{what} did not return within {timeout} s"
        if self._error:
            raise self._error[0]
        return self._result[0]


def wait_for_record(caplog: pytest.LogCaptureFixture, *parts: str, timeout: float = 10.0,
                    running: InThread | None = None) -> logging.LogRecord:
    """The first record whose message holds every one of `parts`; with
    `running`, fail at once (with its result or error) if that ends first."""
    def found() -> list[logging.LogRecord]:
        records = [r for r in list(caplog.records) if all(p in r.getMessage() for p in parts)]
        if not records and running is not None and not running.alive():
            pytest.fail(f"it ended before a log record with {parts}: "
                        f"returned {running.join(0.0, 'it')!r}")
        return records

    return wait_until(found, timeout, f"a log record with {parts}")[0]


# ---- the store ----------------------------------------------------------------------


def test_a_commit_on_a_full_disk_waits_and_loses_no_row(
        small_disk: Callable[[int], Path], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="streamfence.sink")
    disk = small_disk(3)
    path = disk / "transcript.db"
    store = TranscriptStore(str(path))
    try:
        expected = buffer_runs(store, 100)
        filler = disks.fill(disk)
        commit = InThread(store.commit)
        fault = wait_for_record(caplog, "cannot write", str(path), running=commit)
        assert fault.levelno == logging.ERROR
        assert "SQLITE_FULL (database or disk is full); holding 300 events; retrying" \
            in fault.getMessage()
        assert commit.alive(), "the commit returned on a full disk"
        assert store.fault is not None and store.fault.startswith("SQLITE_FULL")
        assert store.fault_since is not None
        filler.unlink()
        assert commit.join(10.0, "the commit after the space was freed") == 100
        assert stored_bodies(path) == expected
        back = wait_for_record(caplog, "writable again")
        assert back.levelno == logging.WARNING
        assert "300 events committed" in back.getMessage()
        assert store.fault is None and store.fault_since is None and store.retries >= 1
        assert store.commit() == 0  # nothing left buffered
    finally:
        store.close()
    assert BAD_ROLLBACK not in caplog.text
    assert len([r for r in caplog.records if "cannot write" in r.getMessage()]) == 1


def test_a_stop_asked_during_the_fault_gives_the_write_up(
        small_disk: Callable[[int], Path], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="streamfence.sink")
    disk = small_disk(3)
    path = disk / "transcript.db"
    stop = threading.Event()
    store = TranscriptStore(str(path), pause=stop.wait)  # True once a stop is asked
    try:
        expected = buffer_runs(store, 50)
        filler = disks.fill(disk)
        commit = InThread(store.commit)
        wait_for_record(caplog, "cannot write", str(path), running=commit)
        stop.set()
        asked = time.monotonic()
        with pytest.raises(StoreStopped) as gave_up:
            commit.join(5.0, "the commit after a stop was asked")
        assert time.monotonic() - asked < 1.0
        message = str(gave_up.value)
        assert message.startswith(f"a stop was asked: gave up writing {path} after ")
        assert "SQLITE_FULL (database or disk is full) (holding 150 events)" in message
        # Given up, not dropped: the rows are still buffered.
        filler.unlink()
        stop.clear()
        assert store.commit() == 50
        assert stored_bodies(path) == expected
    finally:
        store.close()
    assert BAD_ROLLBACK not in caplog.text


def test_the_store_opens_on_a_full_disk_once_space_is_freed(
        small_disk: Callable[[int], Path], caplog: pytest.LogCaptureFixture) -> None:
    """A sink (re)started on a full disk: an open file at this schema version is
    not written to, but its -shm file needs room: the open waits, no crash."""
    caplog.set_level(logging.INFO, logger="streamfence.sink")
    disk = small_disk(3)
    path = disk / "transcript.db"
    TranscriptStore(str(path)).close()  # closed: its -wal and -shm files are gone
    filler = disks.fill(disk)
    opening = InThread(lambda: TranscriptStore(str(path)))
    fault = wait_for_record(caplog, "cannot write", str(path), "the sink waits to open it",
                            running=opening)
    assert fault.levelno == logging.ERROR
    filler.unlink()
    store = opening.join(10.0, "the open after the space was freed")
    try:
        wait_for_record(caplog, "writable again", "opened")
        buffer_runs(store, 3)
        assert store.commit() == 3
    finally:
        store.close()
    assert BAD_ROLLBACK not in caplog.text


def test_a_prune_on_a_full_disk_is_logged_and_tried_later(
        small_disk: Callable[[int], Path], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="streamfence.sink")
    disk = small_disk(3)
    path = disk / "transcript.db"
    store = TranscriptStore(str(path), background_checkpoints=False)
    state = SinkState(store, Nobody(), Nobody(), retention_days=1e-9)
    try:
        for i in range(20):
            store.set_epoch(f"c{i}", 1)
            store.set_done(f"c{i}", 1, "completed", 1)
        store.commit()
        other = sqlite3.connect(path)  # an empty -wal: the delete needs new room
        other.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        other.close()
        filler = disks.fill(disk)
        assert state.retention.prune() == 0  # neither raised nor retried in place
        failed = wait_for_record(caplog, "pruning finished calls", "failed")
        assert failed.levelno == logging.WARNING
        assert "SQLITE_FULL" in failed.getMessage()
        assert state.retention.prune() == 0
        assert len([r for r in caplog.records if "pruning" in r.getMessage()]) == 1
        assert store.fault is None  # a prune is no commit: nothing waits for it
        filler.unlink()
        assert state.retention.prune() == 20
        wait_for_record(caplog, "pruning finished calls", "works again")
    finally:
        store.close()
    assert BAD_ROLLBACK not in caplog.text


def test_stats_do_not_wait_for_the_disk(small_disk: Callable[[int], Path],
                                        caplog: pytest.LogCaptureFixture) -> None:
    """C_STATS commits what is pending first, but does not wait out a fault:
    it answers with the fault, and everything stays for the next commit."""
    caplog.set_level(logging.INFO, logger="streamfence.sink")
    disk = small_disk(3)
    path = disk / "transcript.db"
    store = TranscriptStore(str(path))
    state = SinkState(store, Nobody(), Nobody())
    try:
        expected = buffer_runs(store, 100)
        filler = disks.fill(disk)
        replies: list[bytes] = []
        state.handle_control(Stats("status"), replies.append)
        reply = msgpack.unpackb(replies[-1])
        assert reply[:2] == [R_OK, "status"], reply
        assert reply[2]["storage_fault"].startswith("SQLITE_FULL"), reply[2]
        assert isinstance(reply[2]["storage_fault_since"], float)
        filler.unlink()
        assert state.commits.commit()
        assert stored_bodies(path) == expected
        state.handle_control(Stats(1), replies.append)
        assert msgpack.unpackb(replies[-1])[2]["storage_fault"] is None
    finally:
        store.close()
    assert [r.levelname for r in caplog.records] == ["ERROR", "WARNING"], caplog.text


def test_damage_is_no_storage_fault(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """SQLITE_NOTADB at open: one clear line and the error, no retry."""
    caplog.set_level(logging.INFO, logger="streamfence.sink")
    path = tmp_path / "transcript.db"
    path.write_bytes(b"this is not a database, " * 200)
    with pytest.raises(sqlite3.DatabaseError) as raised:
        TranscriptStore(str(path))
    assert not is_storage_fault(raised.value)
    assert raised.value.sqlite_errorname == "SQLITE_NOTADB"
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"sink: {path} is damaged: SQLITE_NOTADB (file is not a database); the "
                     f"sink stops (`streamfence check` names what is wrong)"]


# ---- the sink process ---------------------------------------------------------------


class LoggedSink(SinkUnderTest):
    """The real sink process (tests/test_sink_process.py), its log records
    shipped to the test's PULL socket as they are to the daemon's."""

    def start(self) -> LoggedSink:
        self.logs: zmq.Socket[bytes] = self.ctx.socket(zmq.PULL)
        self.logs.setsockopt(zmq.LINGER, 0)
        self.logs.bind(self.ep.logs)
        self.sockets.append(self.logs)
        self.said: list[dict[str, Any]] = []
        self.proc = MP.Process(target=run_sink, name="sink-under-test",
                               args=(self.runtime_dir, self.db_path, self.events_endpoint),
                               kwargs={"log_to_supervisor": True})
        self.proc.start()
        self.procs.append(self.proc)
        self.sup = Supervisor(self.ctx, self.ep.sink_ctl)
        self.sockets.append(self.sup.sock)
        self.sup.request(C_STATS, timeout=START_S)  # answered once the sink serves
        self.listener = self.sup.listener = self.new_listener()
        return self

    def record(self, *parts: str, timeout: float = 10.0) -> dict[str, Any]:
        """The first record the sink logged whose message holds all of `parts`."""
        def found() -> list[dict[str, Any]]:
            while self.logs.poll(0):
                self.said.append(msgpack.unpackb(self.logs.recv())[1])
            return [r for r in self.said if all(p in r["msg"] for p in parts)]

        return wait_until(found, timeout, f"the sink to log {parts}")[0]


@pytest.fixture
def sink_on_small_disk(small_disk: Callable[[int], Path],
                       tmp_path_factory: pytest.TempPathFactory
                       ) -> Iterator[tuple[LoggedSink, Path]]:
    """The real sink process with its transcript on a 3 MiB disk, one call
    authorized."""
    runtime = tmp_path_factory.mktemp("rt")  # short: ipc paths must fit in sun_path
    disk = small_disk(3)
    sink = LoggedSink(str(runtime), str(disk / "transcript.db"))
    try:
        sink.start()
        sink.sup.ok(C_AUTHORIZE, "full", 1, False)
        yield sink, disk
    finally:
        sink.close()


def _fault_with_deltas(sink: LoggedSink, disk: Path, n: int) -> tuple[Path, dict[str, Any]]:
    """Fill the disk, send `n` deltas of 2 KB: the sink's stats once it reports
    the fault (it answers C_STATS while it waits)."""
    filler = disks.fill(disk)
    worker = sink.worker()
    for seq in range(1, n + 1):
        worker.send(delta("full", 1, seq, f"{seq:04d}" + "x" * 2000))
    stats = sink.sup.wait_stats(lambda s: s["storage_fault"] is not None,
                                "the sink to report its storage fault")
    return filler, stats


def test_a_faulted_sink_answers_stats_holds_the_rest_and_loses_nothing(
        sink_on_small_disk: tuple[LoggedSink, Path]) -> None:
    sink, disk = sink_on_small_disk
    filler, stats = _fault_with_deltas(sink, disk, 50)
    assert stats["storage_fault"].startswith("SQLITE_FULL"), stats
    assert isinstance(stats["storage_fault_since"], float), stats
    # An op that needs a commit is held; a C_STATS sent after it is answered
    # first (were the op not held, its reply would come before).
    sink.sup.sock.send(encode([C_AUTHORIZE, "held", "other", 1, False]))
    assert sink.sup.stats()["storage_fault"] is not None
    assert not [m for m in sink.sup.inbox if m[1] == "held"], "the op was not held"
    filler.unlink()
    reply = sink.sup._recv_until(lambda m: m[0] in (R_OK, R_REFUSED) and m[1] == "held",
                                 "the held C_AUTHORIZE's reply")
    assert reply[0] == R_OK, reply
    events = sink.events("full", 50)
    assert [e["data"] for e in events] == [f"{s:04d}" + "x" * 2000 for s in range(1, 51)]
    assert [e["seq"] for e in sink.transcript("full")] == list(range(1, 51))
    after = sink.sup.stats()
    assert after["storage_fault"] is None and after["storage_fault_since"] is None
    assert after["storage_retries"] >= 1 and after["accepted"] == 50
    assert sink.proc.is_alive()


def test_a_sigterm_stops_a_faulted_sink_at_once(
        sink_on_small_disk: tuple[LoggedSink, Path]) -> None:
    sink, disk = sink_on_small_disk
    _fault_with_deltas(sink, disk, 50)
    fault = sink.record("cannot write", "SQLITE_FULL")
    assert fault["levelname"] == "ERROR"
    asked = time.monotonic()
    sink.proc.terminate()
    sink.proc.join(5.0)  # the supervisor's SIGKILL comes 5 s after its SIGTERM
    assert not sink.proc.is_alive(), "the faulted sink did not stop within 5 s of SIGTERM"
    assert time.monotonic() - asked < 2.0
    assert sink.proc.exitcode == 0
    gave_up = sink.record("sink: a stop was asked: gave up writing")
    assert gave_up["levelname"] == "ERROR"
    assert re.search(r"SQLITE_FULL \(database or disk is full\) \(holding \d+ events?\)$",
                     gave_up["msg"]), gave_up
    assert not [r for r in sink.said if BAD_ROLLBACK in r["msg"] or r["exc_text"]], sink.said


# ---- a running daemon ------------------------------------------------------------------


def _logged(daemon: DaemonProcess, *parts: str) -> list[dict[str, Any]]:
    """The daemon's log records whose message holds all of `parts`."""
    return [r for r in daemon.log_records() if all(p in r.get("message", "") for p in parts)]


@pytest.mark.slow
def test_a_full_disk_pauses_a_running_call_without_a_sink_restart(
        small_disk: Callable[[int], Path], make_daemon: Any, emu: EmulatorClient,
        tmp_path: Path) -> None:
    text = "".join(f"word{i:05d} " for i in range(12_000))  # 120 KB: 2 KB a chunk
    emu.script("full", [{"fault": "ok", "text": text, "chunks": 60, "chunk_delay_s": 0.05}])
    disk = small_disk(24)
    daemon: DaemonProcess = make_daemon(name=disk.name, start=False)
    daemon.log_path = tmp_path / "daemon.log"  # off the small disk
    daemon.start()
    request = {"model": "gpt-emu#full", "messages": [{"role": "user", "content": "x"}]}
    with daemon.client(timeout_s=30.0) as client:
        call_id = client.submit("emu", request)
        events = client.events(call_id, timeout_s=30.0)
        first = [next(events) for _ in range(3)]  # accepted, authorized: journaled
        sink_pid = client.status()["processes"]["sink"]
        filler = disks.fill(disk)
        try:
            fault = wait_until(lambda: _logged(daemon, "cannot write", "transcript.db",
                                               "SQLITE_FULL"), 10.0,
                               "the sink to log SQLITE_FULL at its commit")[0]
            assert fault["level"] == "ERROR", fault
            during = client.status()  # the sink answers while it waits
            assert (during["sink"]["storage_fault"] or "").startswith("SQLITE_FULL"), \
                during["sink"]
        finally:
            filler.unlink()
        rest = list(events)
        after = client.status()
    assert_one_exact_answer([*first, *rest], emu.log("full"))
    assert during["processes"]["sink"] == after["processes"]["sink"] == sink_pid
    assert after["counters"].get("sink_restarts", 0) == 0, after["counters"]
    assert after["sink"]["storage_fault"] is None
    assert after["sink"]["storage_retries"] >= 1
    assert _logged(daemon, "transcript.db writable again")
    assert BAD_ROLLBACK not in daemon.log_text()
