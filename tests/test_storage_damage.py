"""Storage faults (docs/GUARANTEES.md, "Storage faults"; ARCHITECTURE §4.13):
damage is refused, never forgotten, never hung on.

Process tests: a real daemon leaves a state dir behind (module fixture, two
of them), each test damages a copy of it and runs the real `streamfence
serve`, which must refuse within `REFUSE_WITHIN_S` with the message that
names the file and the fix, leave the files as they were, and start again
once the damage is undone. `streamfence check` is run the same way. Unit
tests hold each rule of the pairing check (`supervisor/storepair.py`) and
the -wal frame check (`supervisor/walframes.py`) on real SQLite files.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import psutil
import pytest

from streamfence.devtools import pages
from streamfence.devtools.emulator.control import EmulatorProcess
from streamfence.protocol.errors import ErrorCode, ProtocolError
from streamfence.protocol.internal import R_OK
from streamfence.protocol.internal.control import AddSubscriber, ListenerOwner
from streamfence.sink.state import SinkState
from streamfence.sink.store import StoreStopped, TranscriptStore
from streamfence.supervisor import storepair, walframes
from streamfence.supervisor.journal import Journal
from streamfence.supervisor.storepair import FileFacts, StoreError
from tests.fakes import Nobody
from tests.harness import DaemonProcess, wait_until
from tests.wires import profile_for, request_for

REFUSE_WITHIN_S = 5.0  # a refused start must be over by then (it used to hang forever)
FIX = ("restore it from a backup", "move the state dir away to start clean")
DB_FILES = ("journal.db", "journal.db-wal", "transcript.db", "transcript.db-wal")


# ---- what a real daemon leaves behind ----------------------------------------------------


@dataclass(frozen=True)
class Template:
    """A stopped daemon's state dir and what its calls were."""

    state_dir: Path
    finished: tuple[str, ...]  # completed calls
    unfinished: str | None  # accepted, streaming when the daemon was SIGKILLed


def _providers(emulator: EmulatorProcess) -> dict[str, dict[str, Any]]:
    return {"emu": dict(profile_for("openai", emulator), stale_timeout_s=30.0)}


def _run_one(daemon: DaemonProcess, key: str) -> str:
    with daemon.client() as client:
        done = client.run("emu", request_for("openai", key), timeout_s=30.0)
    assert done["status"] == "completed", done
    return str(done["call_id"])


@pytest.fixture(scope="module")
def templates(tmp_path_factory: pytest.TempPathFactory,
              emulator: EmulatorProcess) -> Iterator[dict[str, Template]]:
    """"a": two runs (a clean stop, so journal.db holds the first run and
    the generation-1 stamp; then a completed call and an accepted call that
    is streaming when the daemon is SIGKILLed, so journal.db-wal holds the
    second run). "b": another state dir, one completed call, a clean stop."""
    root = tmp_path_factory.mktemp("templates")
    emu = emulator.client()
    emu.script("tpl-stall", [{"fault": "stall", "after": 2, "stall_s": 60.0}])
    a = DaemonProcess(root / "a", _providers(emulator))
    b = DaemonProcess(root / "b", _providers(emulator))
    try:
        a.start()
        first = _run_one(a, "tpl-a1")
        assert a.stop() == 0, a.log_text()[-3000:]
        a.start()
        second = _run_one(a, "tpl-a2")
        with a.client() as client:
            stalled = client.submit("emu", request_for("openai", "tpl-stall"))
        wait_until(lambda: any(r["chunks_sent"] >= 2 for r in emu.log("tpl-stall")), 15,
                   "the stalled call to stream")
        a.kill()
        b.start()
        only = _run_one(b, "tpl-b1")
        assert b.stop() == 0, b.log_text()[-3000:]
        yield {"a": Template(a.state_dir, (first, second), stalled),
               "b": Template(b.state_dir, (only,), None)}
    finally:
        a.cleanup()
        b.cleanup()


def _copy(template: Template, emulator: EmulatorProcess, where: Path) -> DaemonProcess:
    """A daemon (not started) on a copy of the template's state dir."""
    daemon = DaemonProcess(where, _providers(emulator))  # writes its own config there
    for entry in template.state_dir.iterdir():
        if entry.name in ("streamfence.toml", "daemon.log", "run"):
            continue
        if entry.is_dir():
            shutil.copytree(entry, where / entry.name)
        else:
            shutil.copy2(entry, where / entry.name)
    return daemon


@pytest.fixture
def copies(tmp_path: Path, emulator: EmulatorProcess,
           templates: dict[str, Template]) -> Iterator[Any]:
    made: list[DaemonProcess] = []

    def copy(name: str) -> DaemonProcess:
        daemon = _copy(templates[name], emulator, tmp_path / f"copy-{name}")
        made.append(daemon)
        return daemon

    yield copy
    for daemon in made:
        daemon.cleanup()
        assert not daemon.survivors, daemon.survivors


def _meta(path: Path, key: str) -> str:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        row = db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    finally:
        db.close()
    assert row is not None, f"{path} has no {key}"
    return str(row[0])


def _digests(state_dir: Path) -> dict[str, str]:
    """The content of the database files (not -shm: SQLite rebuilds that index)."""
    return {name: hashlib.sha256((state_dir / name).read_bytes()).hexdigest()
            for name in DB_FILES if (state_dir / name).exists()}


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        children: list[psutil.Process] = psutil.Process(pid).children(recursive=True)
        return children
    except psutil.NoSuchProcess:
        return []


def _command(state_dir: Path, *args: str, within: float) -> tuple[int, str, str, float]:
    """Run `streamfence ARGS`; fail (killing it and its children) if it has not
    exited within `within` seconds."""
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "streamfence.cli", *args], cwd=state_dir,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    try:
        out, err = proc.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        children = _descendants(proc.pid)
        for child in children:
            child.kill()
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"`streamfence {' '.join(args)}` neither served nor exited within "
                    f"{within:g} s (it hangs, or it started on a damaged store); it had "
                    f"{len(children)} child process(es); stderr tail:\n{err[-3000:]}")
    return proc.returncode, out, err, time.monotonic() - started


def _refused(daemon: DaemonProcess, *fragments: str, one_line: bool = True) -> str:
    """`streamfence serve` exits non-zero within REFUSE_WITHIN_S, with no
    traceback, and its last line on stderr holds every fragment."""
    code, _, err, took = _command(daemon.state_dir, "serve", "--config",
                                  str(daemon.config_path), within=REFUSE_WITHIN_S)
    assert code != 0, f"serve exited {code} on a damaged store:\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    lines = err.strip().splitlines()
    assert lines, "serve refused without a word"
    if one_line:
        assert len(lines) == 1, err[-3000:]
    for fragment in fragments:
        assert fragment in lines[-1], (fragment, lines[-1])
    assert took < REFUSE_WITHIN_S, took
    return lines[-1]


def _resumes(daemon: DaemonProcess, template: Template) -> None:
    """The daemon starts; every finished call has its result and the
    unfinished one completes: nothing was forgotten."""
    daemon.start()
    with daemon.client() as client:
        for call_id in template.finished:
            done = client.result(call_id)
            assert done is not None and done["status"] == "completed", (call_id, done)
        if template.unfinished is not None:
            client.subscribe(template.unfinished, from_seq=0)
            events = list(client.events(template.unfinished, timeout_s=30.0))
            assert events[-1]["status"] == "completed", events[-1]


# ---- the pair: missing, empty, replaced, mismatched -----------------------------------


@pytest.mark.slow
def test_empty_journal_is_refused_and_nothing_is_touched(copies: Any,
                                                         templates: dict[str, Template]) -> None:
    daemon: DaemonProcess = copies("a")
    journal = daemon.state_dir / "journal.db"
    saved = journal.read_bytes()
    journal.write_bytes(b"")  # truncated to 0 bytes; its -wal is still there
    before = _digests(daemon.state_dir)
    store = _meta(daemon.state_dir / "transcript.db", "store_id")
    _refused(daemon, str(journal), "is empty (0 bytes)", "transcript.db holds 3 calls",
             f"store {store}", "truncated", *FIX)
    assert _digests(daemon.state_dir) == before  # the -wal that holds the calls is kept
    journal.write_bytes(saved)  # the backup
    _resumes(daemon, templates["a"])


@pytest.mark.slow
def test_deleted_journal_wal_is_refused_and_restoring_it_resumes(
        copies: Any, templates: dict[str, Template]) -> None:
    daemon: DaemonProcess = copies("a")
    wal = daemon.state_dir / "journal.db-wal"
    saved = wal.read_bytes()
    wal.unlink()  # the second run's work (its stamp, two calls) was only there
    before = _digests(daemon.state_dir)
    _refused(daemon, str(daemon.state_dir / "journal.db"),
             "is at generation 1 but transcript.db at generation 2", "-wal", *FIX)
    assert _digests(daemon.state_dir) == before
    wal.write_bytes(saved)
    _resumes(daemon, templates["a"])


@pytest.mark.slow
def test_journal_of_another_state_dir_is_refused(copies: Any,
                                                 templates: dict[str, Template]) -> None:
    daemon: DaemonProcess = copies("a")
    for suffix in ("", "-wal", "-shm"):
        (daemon.state_dir / f"journal.db{suffix}").unlink(missing_ok=True)
    shutil.copy2(templates["b"].state_dir / "journal.db", daemon.state_dir / "journal.db")
    ours = _meta(daemon.state_dir / "transcript.db", "store_id")
    theirs = _meta(daemon.state_dir / "journal.db", "store_id")
    assert ours != theirs
    _refused(daemon, str(daemon.state_dir / "journal.db"), f"is store {theirs}",
             f"transcript.db is store {ours}", "different state dirs")


@pytest.mark.slow
def test_state_dir_from_before_store_ids_starts_and_gets_one(copies: Any,
                                                              templates: dict[str, Template]
                                                              ) -> None:
    daemon: DaemonProcess = copies("b")
    for name in ("journal.db", "transcript.db"):
        db = sqlite3.connect(daemon.state_dir / name)
        db.execute("DELETE FROM meta WHERE key IN ('store_id', 'generation', 'pruned_through')")
        db.commit()
        db.close()
    _resumes(daemon, templates["b"])
    assert daemon.stop() == 0
    store = _meta(daemon.state_dir / "journal.db", "store_id")
    assert _meta(daemon.state_dir / "transcript.db", "store_id") == store
    assert _meta(daemon.state_dir / "journal.db", "generation") == "1"
    assert _meta(daemon.state_dir / "transcript.db", "generation") == "1"


# ---- damaged pages -------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("table", ["calls", "requests"])
def test_scribbled_journal_page_is_refused(copies: Any, table: str) -> None:
    """`calls` is read by the pairing check, `requests` only by recovery,
    after the daemon has bound its sockets (it used to hang there, waiting
    on the zygote it had started)."""
    daemon: DaemonProcess = copies("a")
    journal = daemon.state_dir / "journal.db"
    pages.scribble(journal, pages.root_page(journal, table))
    _refused(daemon, str(journal), "is damaged", "malformed", *FIX,
             one_line=table == "calls")


@pytest.mark.slow
def test_scribbled_transcript_page_found_by_recovery_is_refused(copies: Any) -> None:
    """`events` is read at start only by recovery (the done event of each
    unfinished call), which must name the transcript, not the journal."""
    daemon: DaemonProcess = copies("a")
    transcript = daemon.state_dir / "transcript.db"
    pages.scribble(transcript, pages.root_page(transcript, "events"))
    _refused(daemon, str(transcript), "is damaged", "malformed", *FIX, one_line=False)


@pytest.mark.slow
def test_scribbled_transcript_header_is_refused(copies: Any) -> None:
    daemon: DaemonProcess = copies("a")
    transcript = daemon.state_dir / "transcript.db"
    with open(transcript, "r+b") as f:
        f.write(b"this is not SQLite" * 4)
    _refused(daemon, str(transcript), "is damaged", "file is not a database", *FIX)


@pytest.mark.slow
def test_scribbled_page_in_the_transcript_wal_is_refused(copies: Any) -> None:
    """SQLite itself would silently end the WAL at the damaged frame (and
    forget every later commit): the start finds it first."""
    daemon: DaemonProcess = copies("a")
    wal = daemon.state_dir / "transcript.db-wal"
    frames = (wal.stat().st_size - walframes.HEADER_BYTES) // (walframes.FRAME_HEADER_BYTES + 4096)
    assert frames >= 2, f"the SIGKILLed daemon's transcript WAL holds {frames} frame(s)"
    with open(wal, "r+b") as f:  # inside the first frame's page
        f.seek(walframes.HEADER_BYTES + walframes.FRAME_HEADER_BYTES + 1000)
        f.write(b"scribble" * 64)
    before = _digests(daemon.state_dir)
    _refused(daemon, str(wal), "frame 1 of", "fails its checksum", *FIX)
    assert _digests(daemon.state_dir) == before


# ---- streamfence check ---------------------------------------------------------------


def _check(daemon: DaemonProcess) -> tuple[int, str, str]:
    code, out, err, _ = _command(daemon.state_dir, "check", "--config", str(daemon.config_path),
                                 within=30.0)
    return code, out, err


@pytest.mark.slow
def test_check_passes_a_good_state_dir_and_reports_each_damage(copies: Any) -> None:
    daemon: DaemonProcess = copies("a")  # left by a SIGKILL: both -wal files hold work
    code, out, err = _check(daemon)
    assert code == 0, out + err
    store = _meta(daemon.state_dir / "journal.db", "store_id")
    assert f"journal.db: ok (quick_check); store {store}, generation 2, 3 calls" in out, out
    assert f"transcript.db: ok (quick_check); store {store}, generation 2, 3 calls" in out, out
    assert f"pair: ok (store {store}, generation 2)" in out, out

    transcript = daemon.state_dir / "transcript.db"
    page = pages.root_page(transcript, "events")
    sound = transcript.read_bytes()
    with open(transcript, "r+b") as f:  # the header's freelist count: the start never reads it
        f.seek(36)
        f.write((5).to_bytes(4, "big"))
    code, out, err = _check(daemon)
    assert code == 1, out + err
    assert ("transcript.db: DAMAGED (quick_check): *** in database main *** Main freelist: "
            "size is 0 but should be 5") in out, out
    assert "journal.db: ok" in out and "pair: ok" in out, out
    transcript.write_bytes(sound)
    pages.scribble(transcript, page)  # so damaged that quick_check stops on it
    code, out, err = _check(daemon)
    assert code == 1, out + err
    assert "transcript.db: DAMAGED (quick_check): database disk image is malformed" in out, out
    transcript.write_bytes(sound)

    (daemon.state_dir / "journal.db").write_bytes(b"")
    code, out, err = _check(daemon)
    assert code == 1, out + err
    assert "journal.db: empty (0 bytes)" in out, out
    assert "pair: REFUSED" in out and "transcript.db holds 3 calls" in out, out


@pytest.mark.slow
def test_check_refuses_while_a_daemon_runs(copies: Any) -> None:
    daemon: DaemonProcess = copies("b")
    daemon.start()
    assert daemon.proc is not None
    code, out, err = _check(daemon)
    assert code != 0, out + err
    assert f"pid {daemon.proc.pid}" in err and "stop it first" in err, err
    with daemon.client() as client:  # untouched: it still serves
        assert client.status()["processes"]["supervisor"] == daemon.proc.pid


def test_a_refusal_does_not_wait_for_the_sdks_to_import() -> None:
    """The supervisor's modules leave the SDKs (3-5 s to import here) to the
    zygote, so a refused start stays far inside REFUSE_WITHIN_S under load."""
    code = ("import sys, streamfence.cli, streamfence.supervisor.daemon; "
            "print(sorted(m for m in ('openai', 'anthropic', 'boto3', 'botocore') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "[]", out


# ---- the pairing rules, on facts (pure) ------------------------------------------------

J, T = "/s/journal.db", "/s/transcript.db"


def _facts(path: str, blank: str | None = None, store: str | None = None, generation: int = 0,
           calls: int = 0) -> FileFacts:
    return FileFacts(path, blank, store, generation, calls)


def _judge_refuses(journal: FileFacts, transcript: FileFacts, *fragments: str,
                   behind: str | None = None) -> None:
    with pytest.raises(StoreError) as raised:
        storepair.judge(journal, transcript, behind)
    for fragment in fragments:
        assert fragment in str(raised.value), (fragment, str(raised.value))


def test_a_fresh_state_dir_gets_a_new_store() -> None:
    pairing = storepair.judge(_facts(J, "missing"), _facts(T, "missing"), None)
    assert pairing.previous == 0 and pairing.generation == 1 and len(pairing.store_id) == 32


def test_a_pair_from_before_store_ids_gets_one_when_consistent() -> None:
    pairing = storepair.judge(_facts(J, calls=4), _facts(T, calls=3), None)
    assert pairing.previous == 0 and pairing.generation == 1
    _judge_refuses(_facts(J, calls=4), _facts(T, calls=3), "lost work",
                   behind="lost work (call c1: not in the journal)")
    _judge_refuses(_facts(J, calls=4), _facts(T, "missing"), f"{T} is missing",
                   "journal.db holds 4 calls")
    _judge_refuses(_facts(J, "empty (0 bytes)"), _facts(T, calls=3), f"{J} is empty (0 bytes)",
                   "transcript.db holds 3 calls")


def test_a_matching_pair_moves_to_the_next_generation() -> None:
    pairing = storepair.judge(_facts(J, store="s1", generation=4, calls=2),
                              _facts(T, store="s1", generation=4, calls=2), None)
    assert (pairing.store_id, pairing.previous, pairing.generation) == ("s1", 4, 5)
    # A start that stamped the journal but died before the transcript: fine.
    pairing = storepair.judge(_facts(J, store="s1", generation=5), _facts(T, store="s1",
                                                                          generation=4), None)
    assert pairing.generation == 6


@pytest.mark.parametrize("blank", ["missing", "empty (0 bytes)", "empty (no tables)"])
def test_a_lost_journal_is_refused(blank: str) -> None:
    _judge_refuses(_facts(J, blank), _facts(T, store="s1", generation=2, calls=3),
                   f"{J} is {blank} but transcript.db holds 3 calls of store s1", *FIX)


def test_a_replaced_journal_is_refused() -> None:
    _judge_refuses(_facts(J, calls=1), _facts(T, store="s1", generation=2),
                   f"{J} has no store id but transcript.db is store s1", *FIX)
    _judge_refuses(_facts(J, store="s2", generation=2), _facts(T, store="s1", generation=2),
                   f"{J} is store s2 but transcript.db is store s1", "different state dirs")


def test_an_older_journal_or_transcript_is_refused() -> None:
    _judge_refuses(_facts(J, store="s1", generation=3), _facts(T, store="s1", generation=4),
                   f"{J} is at generation 3 but transcript.db at generation 4", "-wal", *FIX)
    _judge_refuses(_facts(J, store="s1", generation=6), _facts(T, store="s1", generation=4),
                   f"{T} is at generation 4 but journal.db at generation 6", *FIX)


def test_a_lost_transcript_is_refused_unless_the_first_start_died_between_the_stamps() -> None:
    pairing = storepair.judge(_facts(J, store="s1", generation=1), _facts(T, "missing"), None)
    assert (pairing.store_id, pairing.generation) == ("s1", 2)
    _judge_refuses(_facts(J, store="s1", generation=1, calls=2), _facts(T, "missing"),
                   f"{T} is missing but journal.db holds 2 calls of store s1", *FIX)
    _judge_refuses(_facts(J, store="s1", generation=3), _facts(T, "empty (0 bytes)"),
                   f"{T} is empty (0 bytes) but journal.db is store s1", *FIX)
    _judge_refuses(_facts(J, store="s1", generation=3), _facts(T, calls=5),
                   f"{T} has no store id but journal.db is store s1", *FIX)


def test_a_journal_behind_the_transcript_is_refused() -> None:
    _judge_refuses(_facts(J, store="s1", generation=3), _facts(T, store="s1", generation=3),
                   f"{J} is behind transcript.db", *FIX, behind="x")


# ---- the cross-check and the stamps, on real files --------------------------------------


def _pair(state_dir: Path) -> tuple[Journal, TranscriptStore]:
    state_dir.mkdir(exist_ok=True)
    pairing = storepair.check(state_dir)
    journal = Journal(str(state_dir / "journal.db"))
    storepair.stamp(state_dir, pairing)
    return journal, TranscriptStore(str(state_dir / "transcript.db"),
                                    background_checkpoints=False)


def _add(journal: Journal, call_id: str, epoch: int) -> None:
    journal.add_call(call_id, "local", None, None, "emu", {"model": "m"}, {})
    if epoch:
        journal.start_attempt(call_id, epoch, "p", None)
    journal.commit()


def test_stamps_make_the_next_check_agree(tmp_path: Path) -> None:
    journal, transcript = _pair(tmp_path)
    journal.close()
    transcript.close()
    first = storepair.check(tmp_path)
    assert first.previous == 1 and first.generation == 2
    assert _meta(tmp_path / "journal.db", "store_id") == first.store_id
    assert _meta(tmp_path / "transcript.db", "store_id") == first.store_id


def test_cross_check_finds_the_calls_the_journal_lost(tmp_path: Path) -> None:
    journal, transcript = _pair(tmp_path)
    _add(journal, "c-known", 2)
    transcript.set_epoch("c-known", 2)
    transcript.set_epoch("c-lost", 1)  # the sink knows a call the journal does not
    transcript.commit()
    with pytest.raises(StoreError, match=r"behind transcript\.db on 1 call .*c-lost: not in "
                                         r"the journal"):
        storepair.check(tmp_path)
    transcript.set_done("c-lost", 1, "completed", 3)
    transcript.set_epoch("c-known", 3)  # a retry's epoch the journal had not synced: allowed
    transcript.commit()
    with pytest.raises(StoreError, match=r"behind transcript\.db on 1 call .*c-lost"):
        storepair.check(tmp_path)
    transcript.set_epoch("c-known", 4)  # two epochs ahead: the journal lost work
    transcript.commit()
    with pytest.raises(StoreError, match=r"behind transcript\.db on 2 calls"):
        storepair.check(tmp_path)
    journal.close()
    transcript.close()


def _finished_an_hour_ago(state_dir: Path, call_id: str) -> None:
    for name, sql in (("journal.db", "UPDATE calls SET finished = ? WHERE call_id = ?"),
                      ("transcript.db", "UPDATE calls SET updated_at = ? WHERE call_id = ?")):
        db = sqlite3.connect(state_dir / name)
        db.execute(sql, (time.time() - 3600.0, call_id))
        db.commit()
        db.close()


def test_cross_check_spares_the_calls_retention_pruned(tmp_path: Path) -> None:
    journal, transcript = _pair(tmp_path)
    db = sqlite3.connect(tmp_path / "journal.db")  # the store is two hours old
    db.execute("UPDATE meta SET value = ? WHERE key = 'pruned_through'", (time.time() - 7200,))
    db.commit()
    db.close()
    _add(journal, "c-old", 1)
    journal.finish_call("c-old", "completed")
    journal.commit()
    transcript.set_done("c-old", 1, "completed", 3)
    transcript.commit()
    _finished_an_hour_ago(tmp_path, "c-old")
    assert journal.prune(time.time() - 60.0) == 1  # the journal forgets it first ...
    assert storepair.check(tmp_path).generation == 2  # ... which is not a loss
    transcript.set_done("c-new", 1, "completed", 3)  # finished after the prune
    transcript.commit()
    with pytest.raises(StoreError, match="c-new: not in the journal"):
        storepair.check(tmp_path)
    journal.close()
    transcript.close()


# ---- the -wal frame check, on real WAL files ---------------------------------------------


def _wal_copy(tmp_path: Path, commits: int) -> Path:
    """A WAL of `commits` commits, copied while its connection is open (as a
    SIGKILL leaves it)."""
    db = sqlite3.connect(tmp_path / "w.db", isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA wal_autocheckpoint=0")
    db.execute("CREATE TABLE t (x BLOB)")
    for i in range(commits):
        db.execute("INSERT INTO t VALUES (?)", (os.urandom(100 + i),))
    copy = tmp_path / "copy.db-wal"
    shutil.copy(tmp_path / "w.db-wal", copy)
    db.close()
    return copy


def _frame_offset(n: int) -> int:
    return walframes.HEADER_BYTES + (n - 1) * (walframes.FRAME_HEADER_BYTES + 4096)


def test_wal_frames_of_a_sound_wal_pass(tmp_path: Path) -> None:
    wal = _wal_copy(tmp_path, 5)
    assert walframes.damaged_frame(str(wal)) is None
    with open(wal, "ab") as f:  # a torn last frame (a crash mid-write) is not damage
        f.write(b"\x00" * 1000)
    assert walframes.damaged_frame(str(wal)) is None
    assert walframes.damaged_frame(str(tmp_path / "absent-wal")) is None


def test_wal_frames_damaged_in_the_middle_are_found(tmp_path: Path) -> None:
    wal = _wal_copy(tmp_path, 5)
    frames = (wal.stat().st_size - walframes.HEADER_BYTES) // (walframes.FRAME_HEADER_BYTES
                                                                + 4096)
    with open(wal, "r+b") as f:
        f.seek(_frame_offset(3) + walframes.FRAME_HEADER_BYTES + 50)
        f.write(b"\xff" * 8)
    found = walframes.damaged_frame(str(wal))
    assert found is not None and f"frame 3 of {frames}" in found and "checksum" in found, found


def test_wal_damaged_last_frame_is_a_torn_write_not_damage(tmp_path: Path) -> None:
    wal = _wal_copy(tmp_path, 3)
    frames = (wal.stat().st_size - walframes.HEADER_BYTES) // (walframes.FRAME_HEADER_BYTES
                                                                + 4096)
    with open(wal, "r+b") as f:
        f.seek(_frame_offset(frames) + walframes.FRAME_HEADER_BYTES + 50)
        f.write(b"\xff" * 8)
    assert walframes.damaged_frame(str(wal)) is None


def test_wal_with_a_damaged_header_is_found(tmp_path: Path) -> None:
    wal = _wal_copy(tmp_path, 3)
    with open(wal, "r+b") as f:
        f.seek(16)
        f.write(b"\x01\x02\x03\x04")  # salt-1
    found = walframes.damaged_frame(str(wal))
    assert found is not None and "header" in found, found


# ---- damage met at run time (issue 29, item 7): a storage fault, never a crash --------
# What the start does not read (an index a new row goes into, the attempts a
# result reads) is met by the running daemon; `tests/test_damage_at_run_time_e2e.py`
# shows the same with a real daemon.


def _damaged_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]


def test_a_write_that_meets_a_damaged_journal_page_is_a_lasting_storage_error(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "journal.db"
    journal = Journal(str(path))
    _add(journal, "old", 1)
    journal.close()
    # (owner, idempotency_key): every new call's row goes into it, nothing else reads it.
    pages.scribble(path, pages.root_page(path, "sqlite_autoindex_calls_2"))
    caplog.set_level(logging.INFO, logger="streamfence.journal")
    journal = Journal(str(path))  # opening does not read it
    try:
        for n in range(3):
            assert journal.add_call(f"new{n}", "local", None, None, "emu", {"model": "m"},
                                    {}) is False
            journal.commit()
            fault = journal.fault
            assert fault is not None and fault.code is ErrorCode.STORAGE_ERROR, fault
            assert journal.take_refused() == [f"new{n}"]
        assert fault is not None
        assert fault.message.startswith(f"{path} is damaged (database disk image is "
                                         "malformed): no new calls are accepted"), fault.message
        assert "run `streamfence check`" in fault.message and "backup" in fault.message
        # The running call's writes do not touch that page: they commit; the damage stays.
        journal.end_attempt("old", 1, "ended", None)
        journal.finish_call("old", "completed")
        journal.commit(retry_now=True)
        assert journal.is_finished("old")
        assert journal.fault is fault
        view = journal.fault_view()
        assert view is not None and view["code"] == "storage_error", view
        assert journal.prune_tick(1.0) == 0  # no prune on a damaged file
    finally:
        journal.close()
    assert _meta_rows(path, "SELECT state FROM calls WHERE call_id = 'old'") == [("done",)]
    assert len(_damaged_lines(caplog)) == 1, caplog.text  # once, not per refused submit


def _meta_rows(path: Path, sql: str) -> list[tuple[Any, ...]]:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return db.execute(sql).fetchall()
    finally:
        db.close()


def test_a_read_that_meets_a_damaged_journal_page_is_refused_not_raised(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "journal.db"
    journal = Journal(str(path))
    _add(journal, "old", 1)
    journal.close()
    pages.scribble(path, pages.root_page(path, "attempts"))  # a result's diagnostics
    pages.scribble(path, pages.root_page(path, "sqlite_autoindex_calls_1"))  # a call by its id
    caplog.set_level(logging.INFO, logger="streamfence.journal")
    journal = Journal(str(path))
    try:
        assert journal.attempts_of("old") == []  # the result goes out without them
        for _ in range(2):
            with pytest.raises(ProtocolError) as refused:
                journal.owner_of("old")
            assert refused.value.code is ErrorCode.STORAGE_ERROR
            assert "journal.db is damaged" in refused.value.message
        assert journal.fault is not None and journal.fault.code is ErrorCode.STORAGE_ERROR
    finally:
        journal.close()
    assert len(_damaged_lines(caplog)) == 1, caplog.text


def test_a_transcript_commit_that_meets_damage_waits_it_out(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """As a storage fault: the events are kept, `status` shows it, and the
    sink is not restarted onto the same page again and again."""
    path = tmp_path / "transcript.db"
    store = TranscriptStore(str(path), background_checkpoints=False)
    store.add("c-old", 1, 1, 1, "done", b"\x80")
    store.commit()
    store.close()
    pages.scribble(path, pages.root_page(path, "events_by_call"))  # every new event goes in it
    caplog.set_level(logging.INFO, logger="streamfence.sink.store")
    tries: list[float] = []

    def pause(seconds: float) -> bool:
        tries.append(seconds)
        return len(tries) == 3  # then a stop is asked

    store = TranscriptStore(str(path), background_checkpoints=False, pause=pause)
    try:
        store.add("c-new", 1, 1, 1, "done", b"\x80")
        with pytest.raises(StoreStopped, match="SQLITE_CORRUPT"):
            store.commit()
        assert store.fault is not None and store.fault.startswith("SQLITE_CORRUPT"), store.fault
    finally:
        store.close()
    assert tries == [0.05, 0.1, 0.2]
    lines = _damaged_lines(caplog)
    assert len(lines) == 1 and str(path) in lines[0] and "streamfence check" in lines[0], lines


def test_the_start_refuses_damage_only_quick_check_reads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    journal, transcript = _pair(tmp_path)
    _add(journal, "c1", 1)
    transcript.set_epoch("c1", 1)
    transcript.commit()
    journal.close()
    transcript.close()
    path = tmp_path / "journal.db"
    pages.scribble(path, pages.root_page(path, "sqlite_autoindex_calls_2"))
    with pytest.raises(StoreError) as refused:
        storepair.check(tmp_path)
    assert f"{path} is damaged" in str(refused.value), refused.value
    assert storepair.FIX in str(refused.value)
    # A file over the cap is left to `streamfence check`, and the start says so.
    caplog.set_level(logging.INFO, logger="streamfence.supervisor")
    monkeypatch.setattr(storepair, "QUICK_CHECK_MAX_BYTES", 0)
    assert storepair.check(tmp_path).generation == 2
    assert "its pages are not checked at start" in caplog.text, caplog.text


class _Listener(Nobody):
    """One listener with room for everything: the frames it was sent."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def replay(self, listener: bytes, events: list[bytes]) -> int:
        self.frames.extend(events)
        return len(events)

    def room(self, listener: bytes) -> int:
        return 1 << 30


def _events_leaf(path: Path, holding: str, not_: str) -> int:
    """The first leaf page of `events` that holds rows of call `holding` and
    none of call `not_`."""
    for page in pages.leaves(path, "events"):
        content = pages.page_bytes(path, page)
        if holding.encode() in content and not_.encode() not in content:
            return page
    raise AssertionError(f"no leaf page holds only call {holding}'s rows")


def test_a_replay_that_meets_a_damaged_page_ends_with_an_error_event(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "transcript.db"
    store = TranscriptStore(str(path), background_checkpoints=False)
    for call_id, n in (("damaged-call", 100), ("sound-call", 3)):
        for seq in range(1, n + 1):
            store.add(call_id, seq, seq, 1, "delta", msgpack.packb(
                {"v": 1, "op": "delta", "call_id": call_id, "seq": seq, "data": "x" * 200}))
        store.set_done(call_id, 1, "completed", n)
        store.commit()
    store.close()
    pages.scribble(path, _events_leaf(path, "damaged-call", "sound-call"))
    caplog.set_level(logging.INFO, logger="streamfence.sink")
    store = TranscriptStore(str(path), background_checkpoints=False)
    listener = _Listener()
    state = SinkState(store, Nobody(), listener)
    try:
        for n, call_id in enumerate(("damaged-call", "damaged-call", "sound-call")):
            reply = msgpack.unpackb(state.replays.subscribe(
                AddSubscriber(n, call_id, "L", 0, False, ListenerOwner("test"))))
            assert reply[0] == R_OK, reply
            wait_until(lambda: not state.replays.serve() and not state.replays.active, 5.0,
                       "the replay to end")
    finally:
        store.close()
    events = [msgpack.unpackb(frame) for frame in listener.frames]
    errors = [e for e in events if e["op"] == "error"]
    assert [(e["call_id"], e["code"], e["ref"]) for e in errors] == \
        [("damaged-call", "storage_error", None)] * 2, errors
    assert "the daemon's transcript is damaged" in errors[0]["message"], errors[0]
    assert [e["seq"] for e in events if e.get("call_id") == "sound-call"] == [1, 2, 3]
    assert state.replays.damaged == 2
    lines = _damaged_lines(caplog)
    assert len(lines) == 1 and str(path) in lines[0] and "streamfence check" in lines[0], lines
