"""The store pair: journal.db and transcript.db know each other
(docs/ARCHITECTURE.md §4.13).

Each file's `meta` table holds the pair's `store_id` (a uuid4, the same in
both) and its `generation` (one more at every start); the journal also holds
`pruned_through`, the newest `finished` time of a call its retention removed.
At start, under the state dir's lock and before either file is opened for
writing, `check` reads both and judges them; `stamp` then writes the next
generation into both. A pair the daemon must not start on raises
`StoreError`, one line naming the file and the fix:

- a -wal file with a damaged frame (streamfence.supervisor.walframes);
- a file SQLite finds damaged ("malformed", "not a database"), in what the
  check reads or in SQLite's `PRAGMA quick_check` of every page (`pages`),
  made at each start, after the other checks, on a file of up to
  `QUICK_CHECK_MAX_BYTES` (measured on a 10 MiB journal and its 30 MiB
  transcript, 2,500 calls: the whole check 3-4 ms before, 36-46 ms with
  both files in the page cache, 0.9-1.1 s read from this VM's disk; a
  larger file is left to `streamfence check`, and the start logs so);
- different store ids (files of two state dirs);
- one file with a store id while the other is missing, empty or without one
  (deleted, truncated or replaced), except what a first start that died
  between the two stamps leaves;
- the journal at an older generation than the transcript (it lost its -wal
  file, or is an older copy), or the transcript two behind the journal;
- the journal behind the transcript (`behind`): a call the transcript holds
  that the journal does not (unless it finished before `pruned_through`:
  retention removes a call from the journal first), or holds at a lower
  epoch. The journal syncs a call and its first epoch before the sink hears
  of it, and a retry's epoch while the sink stores it (epoch_join), so no
  crash or power cut leaves more than one epoch missing on an unfinished
  call the journal has run before (recovery starts above it): anything more
  is the journal's lost work.

Neither file holding a store id is a fresh state dir, or one from before
store ids: it gets a new id when nothing above refuses it.

Reads are read-only connections (`mode=ro`), and a 0-byte file is never
opened: SQLite deletes the -wal file beside an empty database, and the last
read-write connection's close checkpoints the WAL and deletes it, either of
which would destroy what a refusal must leave for the operator.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import sqlite3
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from streamfence.sink.transcript import META_TABLE as TRANSCRIPT_META
from streamfence.sink.transcript import calls_sql
from streamfence.supervisor import walframes
from streamfence.supervisor.journal_file import META_TABLE as JOURNAL_META

JOURNAL = "journal.db"
TRANSCRIPT = "transcript.db"
STORE_ID = "store_id"
GENERATION = "generation"
PRUNED_THROUGH = "pruned_through"
# A finished call the journal does not hold counts as lost only if it ended
# this long after `pruned_through` (the clock may step between the sink's
# done and the journal's finish).
PRUNE_SLACK_S = 60.0
FIX = "restore it from a backup, or move the state dir away to start clean"
LOW_SPACE_BYTES = 1 << 20  # an error opening a file on a disk with less free is "full"
QUICK_CHECK_MAX_BYTES = 32 << 20  # a start checks every page of a file up to this size
_SHOWN = 3  # quick_check's problems named in a refusal, at most

log = logging.getLogger("streamfence.supervisor")


def _free_bytes(path: str) -> int | None:
    try:
        return shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
    except OSError:
        return None


class StoreError(Exception):
    """A store file the daemon must not start on (one line: the file, the fault, the fix)."""


@dataclass(frozen=True, slots=True)
class FileFacts:
    """What one file of the pair holds, as `read_facts` found it."""

    path: str
    blank: str | None = None  # why it holds nothing: "missing", "empty (0 bytes)", ...
    store_id: str | None = None
    generation: int = 0
    calls: int = 0
    pruned_through: float | None = None  # the journal's (see the module docstring)


@dataclass(frozen=True, slots=True)
class Pairing:
    """The verdict: the pair's store id and this start's generation."""

    store_id: str
    generation: int
    previous: int  # the generation found; 0: a new store id (fresh, or from before ids)


def _calls(n: int) -> str:
    return "no calls" if n == 0 else "1 call" if n == 1 else f"{n} calls"


def _store_error(path: str, exc: sqlite3.DatabaseError) -> StoreError:
    if isinstance(exc, sqlite3.OperationalError):  # locked, I/O error, permissions, full
        free = _free_bytes(path)
        if free is not None and free < LOW_SPACE_BYTES:
            # SQLite says "disk I/O error" when it cannot even create the -shm file.
            return StoreError(f"{path} cannot be written: the disk holding it is full "
                              f"({free} bytes free; {exc}); free space and start again")
        return StoreError(f"{path} cannot be read ({exc})")
    return StoreError(f"{path} is damaged ({exc}): {FIX}; `streamfence check` reports every "
                      f"damaged file")  # malformed, not a database


@contextlib.contextmanager
def reading(path: str) -> Iterator[None]:
    """SQLite's errors on `path` as a StoreError naming it."""
    try:
        yield
    except sqlite3.DatabaseError as exc:
        raise _store_error(path, exc) from None


def read_only_uri(path: str) -> str:
    """Read-only; and with no -wal file, `immutable`: else SQLite creates one."""
    wal = path + "-wal"
    return (Path(path).absolute().as_uri() + "?mode=ro"
            + ("" if os.path.exists(wal) else "&immutable=1"))


def open_read_only(path: str) -> sqlite3.Connection:
    return sqlite3.connect(read_only_uri(path), uri=True)


def _damaged_one(*paths: str) -> str:
    """Which of the files an error of a query over all of them came from (the
    first whose quick_check fails; the first, if none does)."""
    for path in paths:
        try:
            db = open_read_only(path)
            try:
                if [r[0] for r in db.execute("PRAGMA quick_check")] != ["ok"]:
                    return path
            finally:
                db.close()
        except sqlite3.DatabaseError:
            return path
    return paths[0]


def read_facts(path: str) -> FileFacts:
    """One file's facts; StoreError if SQLite cannot read it."""
    if not os.path.exists(path):
        return FileFacts(path, "missing")
    if os.path.getsize(path) == 0:
        return FileFacts(path, "empty (0 bytes)")  # never opened: see the module docstring
    with reading(path):
        db = open_read_only(path)
        try:
            tables = {r[0] for r in db.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table'")}
            if not tables:
                return FileFacts(path, "empty (no tables)")
            meta = dict(db.execute("SELECT key, value FROM meta")) if "meta" in tables else {}
            # NOT INDEXED: every page of the table is read, so that damage there
            # is found here, named as this file's (count(*) reads an index).
            calls = db.execute("SELECT count(*) FROM calls NOT INDEXED").fetchone()[0] \
                if "calls" in tables else 0
        finally:
            db.close()
    try:
        return FileFacts(path, None, str(meta[STORE_ID]) if STORE_ID in meta else None,
                         int(meta.get(GENERATION, 0)), int(calls),
                         float(meta[PRUNED_THROUGH]) if PRUNED_THROUGH in meta else None)
    except (TypeError, ValueError):
        raise StoreError(f"{path} is damaged (its meta rows are not what this daemon wrote: "
                         f"{meta!r}): {FIX}") from None


def pages(facts: FileFacts) -> None:
    """StoreError if SQLite's quick_check finds a damaged page in the file
    (module docstring); a file over QUICK_CHECK_MAX_BYTES is not checked."""
    if facts.blank:
        return
    size = os.path.getsize(facts.path) + (os.path.getsize(facts.path + "-wal")
                                          if os.path.exists(facts.path + "-wal") else 0)
    if size > QUICK_CHECK_MAX_BYTES:
        log.info("stores: %s is %d MiB: its pages are not checked at start (over %d MiB); "
                 "`streamfence check` checks them with the daemon stopped", facts.path,
                 size >> 20, QUICK_CHECK_MAX_BYTES >> 20)
        return
    with reading(facts.path):
        db = open_read_only(facts.path)
        try:
            problems = [" ".join(str(r[0]).split()) for r in db.execute("PRAGMA quick_check")]
        finally:
            db.close()
    if problems != ["ok"]:
        more = f" (+{len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
        raise StoreError(f"{facts.path} is damaged (quick_check: "
                         f"{'; '.join(problems[:_SHOWN])}{more}): {FIX}")


_BEHIND = """
WITH j(call_id, epoch) AS ({journal_calls}),
t(call_id, epoch, finished, updated_at) AS ({transcript_calls})
SELECT count(*), min(t.call_id), t.epoch, j.epoch
FROM t LEFT JOIN j ON j.call_id = t.call_id
WHERE (j.call_id IS NULL AND (NOT t.finished OR t.updated_at > ?))
   OR j.epoch < t.epoch - (j.epoch >= 1 AND NOT t.finished)
"""


def behind(journal: FileFacts, transcript: FileFacts) -> str | None:
    """What the transcript holds that the journal lost ("on 2 calls (call c:
    not in the journal)"), or None. Reads every row of both `calls` tables."""
    if journal.blank or transcript.blank or transcript.calls == 0:
        return None  # nothing to compare: `judge` decides on blank files
    # A journal from before store ids may have pruned anything that finished.
    exempt = math.inf if journal.store_id is None else (journal.pruned_through or 0.0)
    try:
        db = open_read_only(journal.path)
        try:
            has_calls = db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND "
                                   "name = 'calls'").fetchone()
            db.execute("ATTACH DATABASE ? AS transcript", (read_only_uri(transcript.path),))
            sql = _BEHIND.format(journal_calls="SELECT call_id, epoch FROM main.calls"
                                 if has_calls else "SELECT NULL, NULL WHERE 0",
                                 transcript_calls=calls_sql("transcript"))
            n, call_id, t_epoch, j_epoch = db.execute(sql, (exempt + PRUNE_SLACK_S,)).fetchone()
        finally:
            db.close()
    except sqlite3.DatabaseError as exc:
        raise _store_error(_damaged_one(journal.path, transcript.path), exc) from None
    if not n:
        return None
    what = "not in the journal" if j_epoch is None else \
        f"epoch {j_epoch} in the journal, {t_epoch} in the transcript"
    return f"on {_calls(n)} (call {call_id}: {what})"


def judge(journal: FileFacts, transcript: FileFacts, behind: str | None) -> Pairing:
    """The verdict on the pair (the rules of the module docstring), from what
    `read_facts` and `behind` found. Pure."""
    j, t = journal, transcript
    if j.store_id and t.store_id and j.store_id != t.store_id:
        raise StoreError(f"{j.path} is store {j.store_id} but {TRANSCRIPT} is store "
                         f"{t.store_id}: the two files come from different state dirs; put "
                         f"back the {JOURNAL} and {TRANSCRIPT} that belong together, or move "
                         f"the state dir away to start clean")
    if t.store_id and not j.store_id:
        if j.blank:
            raise StoreError(f"{j.path} is {j.blank} but {TRANSCRIPT} holds {_calls(t.calls)} "
                             f"of store {t.store_id}: the journal was deleted, truncated or "
                             f"replaced; {FIX}")
        raise StoreError(f"{j.path} has no store id but {TRANSCRIPT} is store {t.store_id}: "
                         f"the journal was replaced (by a copy from before store ids, or "
                         f"another state dir's); {FIX}")
    # The journal is stamped first: a first start (or the start that gave an
    # old pair its id) may have died before the transcript's stamp.
    if j.store_id and not t.store_id and (j.generation > 1 or (t.blank and j.calls)):
        if t.blank:
            held = f"holds {_calls(j.calls)} of" if j.calls else "is"
            raise StoreError(f"{t.path} is {t.blank} but {JOURNAL} {held} store "
                             f"{j.store_id} (generation {j.generation}): the transcript was "
                             f"deleted, truncated or replaced; {FIX}")
        raise StoreError(f"{t.path} has no store id but {JOURNAL} is store {j.store_id} "
                         f"(generation {j.generation}): the transcript was replaced (by a "
                         f"copy from before store ids, or another state dir's); {FIX}")
    if j.store_id and t.store_id:
        if j.generation < t.generation:
            raise StoreError(f"{j.path} is at generation {j.generation} but {TRANSCRIPT} at "
                             f"generation {t.generation}: the journal lost its latest writes "
                             f"(its -wal file deleted?) or is an older copy; restore it from "
                             f"a backup (with its -wal file), or move the state dir away to "
                             f"start clean")
        if j.generation > t.generation + 1:
            raise StoreError(f"{t.path} is at generation {t.generation} but {JOURNAL} at "
                             f"generation {j.generation}: the transcript is an older copy; "
                             f"{FIX}")
    if not j.store_id and not t.store_id:
        if t.blank and j.calls:
            raise StoreError(f"{t.path} is {t.blank} but {JOURNAL} holds {_calls(j.calls)}: "
                             f"the transcript was deleted, truncated or replaced; {FIX}")
        if j.blank and t.calls:
            raise StoreError(f"{j.path} is {j.blank} but {TRANSCRIPT} holds "
                             f"{_calls(t.calls)}: the journal was deleted, truncated or "
                             f"replaced; {FIX}")
    if behind is not None:
        raise StoreError(f"{j.path} is behind {TRANSCRIPT} {behind}: the journal lost work "
                         f"(its -wal file deleted, or an older copy put back); {FIX}")
    store_id = j.store_id or t.store_id
    previous = max(j.generation, t.generation)
    if store_id is None:
        return Pairing(uuid.uuid4().hex, 1, 0)
    return Pairing(store_id, previous + 1, previous)


def check_wal(db_path: str) -> None:
    """StoreError if the -wal file beside `db_path` has a damaged frame."""
    wal = db_path + "-wal"
    try:
        found = walframes.damaged_frame(wal)
    except OSError as exc:
        raise StoreError(f"{wal} cannot be read ({exc.strerror})") from None
    if found is not None:
        raise StoreError(f"{wal} is damaged: {found}; {FIX}")


def check(state_dir: Path, cluster: bool = False) -> Pairing:
    """The verdict on the state dir's pair (StoreError: refuse to start).
    `cluster`: the transcript also holds calls the journal never had (other
    hosts' calls followed here, calls taken over at an epoch the journal
    learns only when it runs them: ARCHITECTURE §4.17), so "the journal is
    behind" is not looked for; the cluster's log is the record there."""
    journal_path, transcript_path = str(state_dir / JOURNAL), str(state_dir / TRANSCRIPT)
    check_wal(journal_path)
    check_wal(transcript_path)
    # The transcript first: whatever it holds, the journal held before, so the
    # journal read second is never behind it (were a daemon writing both).
    transcript = read_facts(transcript_path)
    journal = read_facts(journal_path)
    pairing = judge(journal, transcript, None if cluster else behind(journal, transcript))
    pages(transcript)  # the slowest check last: the others refuse in milliseconds
    pages(journal)
    return pairing


def _write_meta(path: str, ddl: str, rows: Mapping[str, str | int | float]) -> None:
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("PRAGMA synchronous=FULL")  # on disk before the next file is stamped
        db.execute("BEGIN IMMEDIATE")
        db.execute(ddl)
        db.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", rows.items())
        db.execute("COMMIT")
    finally:
        db.close()


def stamp(state_dir: Path, pairing: Pairing) -> None:
    """Write this start's generation (and a new store id) into both files: the
    journal first, then the transcript (created if missing; the only write to
    it that is not the sink's, made before the sink starts). Call it while
    the Journal holds journal.db open: this connection's close then leaves
    the journal's stamp in its -wal file until SQLite's next checkpoint, so
    losing that file shows as the generation going back."""
    rows: dict[str, str | int | float] = {STORE_ID: pairing.store_id,
                                          GENERATION: pairing.generation}
    journal_rows = dict(rows)
    if pairing.previous == 0:
        # A new id: what finished before now and is not in the journal was
        # pruned before there were marks (or there is nothing yet).
        journal_rows[PRUNED_THROUGH] = time.time() - PRUNE_SLACK_S
    with reading(str(state_dir / JOURNAL)):
        _write_meta(str(state_dir / JOURNAL), JOURNAL_META, journal_rows)
    with reading(str(state_dir / TRANSCRIPT)):
        _write_meta(str(state_dir / TRANSCRIPT), TRANSCRIPT_META, rows)
