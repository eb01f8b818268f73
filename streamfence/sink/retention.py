"""The sink's retention schedule: when finished calls leave its transcript.

`[daemon] retention_days`, passed at spawn (0: keep forever). The sink
prunes its own file, the only writer that it is. `prune` (called by the
loop when `due` has come) commits what is pending, then deletes one batch of
finished calls in one transaction (`TranscriptStore.prune`): at most
`transcript.PRUNE_BATCH`, and none after `PRUNE_BUDGET_S` spent, so deltas
wait a few milliseconds at most; the next batch is due `PRUNE_EVERY_S`
later, or `PRUNE_BACKLOG_S` while finished calls are still due. The first
batch waits `PRUNE_FIRST_S` after start (the supervisor's recovery reads the
transcript then). The transcript keeps a finished call a little longer than
the journal (`prune_grace_s`: a quarter of the retention, at most a minute),
so a call the journal still knows always has its events. A failed prune (a
storage fault, say) is not waited out: it is tried again `PRUNE_EVERY_S`
later, and logged once per run of failures.
"""

from __future__ import annotations

import logging
import sqlite3
import time

from streamfence.protocol.sqlite_faults import is_damage
from streamfence.sink.commits import Commits
from streamfence.sink.store import TranscriptStore

log = logging.getLogger("streamfence.sink")

PRUNE_BUDGET_S = 0.003  # time spent deleting per transaction, at most ...
PRUNE_EVERY_S = 5.0  # ... between prune transactions ...
PRUNE_BACKLOG_S = 0.05  # ... or this, while finished calls are still due
PRUNE_FIRST_S = 10.0  # the first one this long after start
PRUNE_GRACE_MAX_S = 60.0


def prune_grace_s(retention_s: float) -> float:
    """How much longer than the journal the transcript keeps a finished call."""
    return min(PRUNE_GRACE_MAX_S, retention_s / 4)


class Retention:
    """Owns the retention period and when the next prune is due."""

    def __init__(self, store: TranscriptStore, commits: Commits, retention_days: float) -> None:
        self._store = store
        self._commits = commits
        self.retention_s = max(0.0, retention_days) * 86400.0
        # monotonic time of the next prune transaction (None: retention is off)
        self.due: float | None = (time.monotonic() + PRUNE_FIRST_S
                                  if self.retention_s > 0 else None)
        self.failing = False  # the last prune failed (logged once until one works)

    def prune(self) -> int:
        """One retention batch (see the module docstring); returns the calls deleted.
        Their LiveCalls, if still in memory, stay: finished, they refuse everything."""
        now = time.monotonic()
        self.due = now + PRUNE_EVERY_S
        if self._commits.pending_events:
            self._commits.commit()  # publish what is accepted before the delete's time is spent
        store = self._store
        older_than = time.time() - self.retention_s - prune_grace_s(self.retention_s)
        try:
            removed = store.prune(older_than, budget_s=PRUNE_BUDGET_S)
        except sqlite3.DatabaseError as exc:  # a storage fault or damage: not waited out here
            if not (isinstance(exc, sqlite3.OperationalError) or is_damage(exc)):
                raise
            if not self.failing:  # once per run of failures: a full disk fails each try
                log.warning("sink: pruning finished calls from %s failed (tried again every "
                            "%g s): %s (%s)", store.path, PRUNE_EVERY_S,
                            exc.sqlite_errorname, exc)
            self.failing = True
            return 0
        if self.failing:
            self.failing = False
            log.info("sink: pruning finished calls from %s works again", store.path)
        if store.prune_more:
            self.due = now + PRUNE_BACKLOG_S
        if removed:
            log.debug("sink: pruned %d finished calls in %.1f ms", removed,
                      (time.monotonic() - now) * 1000)
        return removed
