"""Damage SQLite files page by page, for the tests and scripts that show what
the daemon does with a damaged store (tests/test_storage_damage.py,
tests/test_damage_at_run_time_e2e.py, scripts/hostile/damaged_pages.py).

A page is overwritten with other bytes in the main file, so the file must
hold every page first: `checkpointed` empties its WAL into it (which also
makes a running daemon's connections read their pages from the file again).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from streamfence.devtools.launcher import wait_until

PAGE = 4096  # the stores' page size (SQLite's default)


def checkpointed(path: Path, timeout_s: float = 10.0) -> sqlite3.Connection:
    """A connection to `path` once its WAL is checkpointed and emptied into it."""
    db = sqlite3.connect(path, timeout=5.0, isolation_level=None)

    def emptied() -> bool:
        busy, frames, _ = db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        return bool(busy == 0 and frames == 0)

    try:
        wait_until(emptied, timeout_s, f"{path.name}'s WAL to be checkpointed into it")
    except TimeoutError:
        db.close()
        raise
    return db


def scribble(path: Path, page: int) -> None:
    """Overwrite page `page` (counted from 1) of the main file with other bytes."""
    with open(path, "r+b") as f:
        f.seek((page - 1) * PAGE)
        f.write(bytes(range(256)) * (PAGE // 256))


def root_page(path: Path, name: str) -> int:
    """The root page of table or index `name`, every page in the file."""
    db = checkpointed(path)
    try:
        row = db.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (name,)).fetchone()
        page_size = db.execute("PRAGMA page_size").fetchone()[0]
    finally:
        db.close()
    if row is None:
        raise LookupError(f"{path} has no table or index {name!r}")
    if page_size != PAGE:
        raise ValueError(f"{path} has pages of {page_size} bytes, not {PAGE}")
    return int(row[0])


def leaves(path: Path, table: str) -> list[int]:
    """The leaf pages of `table`, in key order, every page in the file."""
    db = checkpointed(path)
    try:
        return [int(r[0]) for r in db.execute(
            "SELECT pageno FROM dbstat WHERE name = ? AND pagetype = 'leaf' ORDER BY path",
            (table,))]
    finally:
        db.close()


def page_bytes(path: Path, page: int) -> bytes:
    """What page `page` of the main file holds now."""
    with open(path, "rb") as f:
        f.seek((page - 1) * PAGE)
        return f.read(PAGE)
