"""Which of SQLite's errors are storage faults: the one test that both stores
(the journal, supervisor/journal.py, and the transcript, sink/store.py) use
to decide whether a failed write is waited out (docs/ARCHITECTURE.md §4.15).

A storage fault is an error of the disk or of a lock, not of the file's
content or of our SQL: the same write can succeed later (space freed, the
lock released, the disk back, the file system remounted read-write,
descriptors freed), so it is tried again. Each name covers its extended
codes (SQLITE_IOERR_WRITE, SQLITE_BUSY_SNAPSHOT, SQLITE_READONLY_DBMOVED,
...). Damage (SQLITE_CORRUPT, SQLITE_NOTADB: `is_damage`) is none: the file
is not what we wrote, and trying again cannot help; each store says what it
does with it (a lasting fault, in the journal and the sink's commits).
"""

from __future__ import annotations

import sqlite3

STORAGE_FAULTS = ("SQLITE_FULL", "SQLITE_IOERR", "SQLITE_BUSY", "SQLITE_LOCKED",
                  "SQLITE_READONLY", "SQLITE_CANTOPEN")
DAMAGE = ("SQLITE_CORRUPT", "SQLITE_NOTADB")


def is_storage_fault(exc: BaseException) -> bool:
    """Is `exc` an error of the disk or of a lock (worth another try), not of
    the file's content or a bug?"""
    if not isinstance(exc, sqlite3.OperationalError):
        return False
    name = exc.sqlite_errorname or ""
    return any(name == f or name.startswith(f + "_") for f in STORAGE_FAULTS)


def is_damage(exc: BaseException) -> bool:
    """Is `exc` SQLite finding the file is not what it wrote (a damaged page)?"""
    return isinstance(exc, sqlite3.DatabaseError) and \
        (exc.sqlite_errorname or "").startswith(DAMAGE)
