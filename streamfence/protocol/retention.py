"""How a store forgets finished calls (docs/ARCHITECTURE.md §4.11): the one
batched delete that the journal (supervisor) and the transcript (sink) each
run on their own file, and `streamfence prune` runs by hand.

`delete_oldest` runs inside a transaction its caller opened: the oldest
finished calls before a cutoff, at most `limit` and (with `budget_s`) until
that much time is spent, each with its rows in the other tables.
`prune_file` repeats it on a file from another process, in short
transactions with a pause between them, so the running daemon gets its turns.

`rollback_if_open` is how every writer of ours ends a transaction that
failed: SQLite may already have rolled it back (after SQLITE_FULL or
SQLITE_IOERR, say), and a ROLLBACK then raises "cannot rollback - no
transaction is active", which used to replace the error that mattered.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Sequence

BATCH = 200  # finished calls deleted per transaction, at most
BUSY_TIMEOUT_S = 10.0  # another process holding the write lock


def delete_oldest(conn: sqlite3.Connection, select_ids: str, deletes: Sequence[str],
                  older_than: float, limit: int, budget_s: float | None) -> tuple[int, bool]:
    """`select_ids` takes (older_than, limit) and yields call ids oldest first;
    each of `deletes` takes one call id. Returns (calls deleted, more due)."""
    start = time.perf_counter()
    ids = [r[0] for r in conn.execute(select_ids, (older_than, limit))]
    removed = 0
    for call_id in ids:
        for sql in deletes:
            conn.execute(sql, (call_id,))
        removed += 1
        if budget_s is not None and time.perf_counter() - start >= budget_s:
            break
    return removed, removed >= limit or removed < len(ids)


def rollback_if_open(conn: sqlite3.Connection) -> None:
    """End `conn`'s failed transaction, if SQLite has not ended it already. For
    an `except` block that re-raises: a ROLLBACK that fails too (the disk
    gone) is not raised over the error being handled; the transaction then
    stays open, and the caller's next try must roll it back first."""
    if conn.in_transaction:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")


def in_transaction(conn: sqlite3.Connection, begin: str, select_ids: str,
                   deletes: Sequence[str], older_than: float, limit: int,
                   budget_s: float | None) -> tuple[int, bool]:
    """`delete_oldest` in a transaction of its own (`begin`: BEGIN or BEGIN
    IMMEDIATE). Any error is raised as it came, the transaction rolled back."""
    conn.execute(begin)
    try:
        result = delete_oldest(conn, select_ids, deletes, older_than, limit, budget_s)
        conn.execute("COMMIT")
    except BaseException:
        rollback_if_open(conn)
        raise
    return result


def prune_file(path: str, index: str, select_ids: str, deletes: Sequence[str],
               older_than: float, batch: int = BATCH, budget_s: float = 0.01,
               pause_s: float = 0.01) -> int:
    """Every finished call before `older_than` in the file at `path`, in
    transactions of at most `batch` calls and about `budget_s`; `index` is
    created first (a file no daemon of this version has opened lacks it). A
    lost prune is simply done again, so no fsync. Returns the calls deleted."""
    conn = sqlite3.connect(path, isolation_level=None, timeout=BUSY_TIMEOUT_S)
    try:
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute(index)
        total = 0
        while True:
            removed, more = in_transaction(conn, "BEGIN IMMEDIATE", select_ids, deletes,
                                           older_than, batch, budget_s)
            total += removed
            if not more:
                return total
            time.sleep(pause_s)  # the daemon's turn
    finally:
        conn.close()
