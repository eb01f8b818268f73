"""`streamfence check`: is the state dir's store sound?

For journal.db and transcript.db of `--config`'s state dir: their -wal
file's frames (supervisor/walframes.py), SQLite's `PRAGMA quick_check` (or,
with `--full`, `integrity_check`, which also checks every index against its
table), what each holds (store id, generation, calls), then the pairing
check the daemon runs at start (supervisor/storepair.py). One line per file
and one for the pair; exit status 0 when all is well, 1 otherwise.

It runs with the daemon stopped, and refuses while one runs: it takes the
state dir's lock for its duration (a daemon started meanwhile stops at
once, naming it), because a check reads every page and holds a read
snapshot so long that the daemon's WAL could not be checkpointed. Every
read is read-only (storepair.open_read_only): it never checkpoints a WAL
nor deletes a -wal file.
"""

from __future__ import annotations

import os
import sqlite3
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from streamfence.cli.common import config_option, load

if TYPE_CHECKING:
    from streamfence.supervisor.storepair import FileFacts

_SHOWN = 5  # problems printed per file, at most


def _integrity(path: str, pragma: str) -> list[str]:
    """SQLite's problems with the file (none: it is sound)."""
    from streamfence.supervisor.storepair import open_read_only

    try:
        db = open_read_only(path)
        try:
            rows = [str(r[0]) for r in db.execute(f"PRAGMA {pragma}")]
        finally:
            db.close()
    except sqlite3.DatabaseError as exc:  # a page so damaged that the check stops on it
        return [str(exc)]
    return [] if rows == ["ok"] else [" ".join(row.split()) for row in rows]  # one line each


def _check_file(path: str, pragma: str) -> tuple[bool, FileFacts | None]:
    """Print one file's line; (sound, its facts, None if it cannot be read)."""
    from streamfence.supervisor import storepair

    name = os.path.basename(path)
    try:
        storepair.check_wal(path)
        facts = storepair.read_facts(path)
        problems = [] if facts.blank else _integrity(path, pragma)
    except storepair.StoreError as exc:
        click.echo(f"{name}: DAMAGED: {exc}")
        return False, None
    if problems:
        more = f" (+{len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
        click.echo(f"{name}: DAMAGED ({pragma}): {'; '.join(problems[:_SHOWN])}{more}")
        return False, facts
    if facts.blank:
        wal = path + "-wal"
        left = f"; its -wal file ({os.path.getsize(wal)} bytes) is left as it is" \
            if os.path.exists(wal) and os.path.getsize(wal) else ""
        click.echo(f"{name}: {facts.blank}{left}")
        return True, facts
    store = f"store {facts.store_id}, generation {facts.generation}" if facts.store_id \
        else "no store id yet"
    click.echo(f"{name}: ok ({pragma}); {store}, {facts.calls} calls")
    return True, facts


@click.command()
@config_option
@click.option("--full", is_flag=True, default=False,
              help="PRAGMA integrity_check (also every index against its table; slower) "
                   "instead of quick_check.")
def check(config_path: str | None, full: bool) -> None:
    """Check journal.db and transcript.db (pages, -wal frames, and that they belong
    together) with the daemon stopped; exit 0 when all is well."""
    from streamfence.supervisor import statedir, storepair

    cfg = load(config_path)
    state_dir = Path(cfg.state_dir)
    if not state_dir.is_dir():
        raise click.ClickException(f"no state dir {cfg.state_dir!r} (daemon.state_dir of the "
                                   f"configuration): nothing to check")
    try:
        lock = statedir.StateLock(state_dir)
    except statedir.StateDirBusy as exc:
        raise click.ClickException(f"a streamfence daemon (pid {exc.holder}) is running on "
                                   f"{state_dir}: stop it first (a check reads every page of "
                                   f"both files, which the daemon writes)") from None
    except statedir.StateDirError as exc:
        raise click.ClickException(str(exc)) from None
    pragma = "integrity_check" if full else "quick_check"
    try:
        ok_j, journal = _check_file(str(state_dir / storepair.JOURNAL), pragma)
        ok_t, transcript = _check_file(str(state_dir / storepair.TRANSCRIPT), pragma)
        if journal is None or transcript is None:
            click.echo("pair: not checked (a file cannot be read)")
            sys.exit(1)
        try:
            pairing = storepair.judge(journal, transcript,
                                      storepair.behind(journal, transcript))
        except storepair.StoreError as exc:
            click.echo(f"pair: REFUSED: {exc}")
            sys.exit(1)
        if pairing.previous == 0 and (journal.calls or transcript.calls):
            click.echo(f"pair: ok (no store id yet: the next start writes {pairing.store_id} "
                       f"into both)")
        elif pairing.previous == 0:
            click.echo("pair: ok (no store yet: the next start creates it)")
        else:
            click.echo(f"pair: ok (store {pairing.store_id}, generation {pairing.previous})")
        sys.exit(0 if ok_j and ok_t else 1)
    finally:
        lock.release()
