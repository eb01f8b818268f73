"""The answer to `calls` (docs/PROTOCOL.md "calls"): the calls an identity
may see, newest first, from the journal, with the live calls' state from
the AttemptDriver's LiveCalls and their running attempt's chunks from its
worker's liveness row.

Scoped by who asks (docs/SECURITY.md): a client sees only its own calls,
whatever its `identity` filter says; an admin sees every call. A page is
one indexed read (`calls_created`, `calls_owner_created`: newest first,
stopping at `limit`), plus the attempts of that page's calls by their
primary key, so its cost does not grow with the finished calls behind it.
Reads run in the supervisor's loop, in its own connection's snapshot.
"""

from __future__ import annotations

import sqlite3
from typing import Any

import msgpack

from streamfence.config.identities import Identity
from streamfence.protocol.errors import ErrorCode, ProtocolError
from streamfence.protocol.messages import VERSION, Op
from streamfence.protocol.queries import Calls, calls_cursor
from streamfence.supervisor.livecalls import LiveCalls
from streamfence.supervisor.pool import Pool

_ROW = ("call_id", "identity", "session_id", "provider", "model", "state", "status", "epoch",
        "attempts", "created", "finished", "taken_from", "taken_epoch")
_SELECT = ("SELECT call_id, owner, session_id, provider, model, state, status, epoch, attempts, "
           "created, finished, taken_from, taken_epoch FROM calls")
_ATTEMPTS = ("SELECT call_id, attempt, started, ended, worker_pid, how, finish_reason, "
             "error_class, error_code, first_chunk_ms, chunks, bytes, deltas, chars "
             "FROM attempts WHERE call_id IN ({}) ORDER BY call_id, attempt")
_ATTEMPT = ("attempt", "started", "ended", "worker_pid", "how", "finish_reason", "error_class",
            "error_code", "first_chunk_ms", "chunks", "bytes", "deltas", "chars")
_STATUS_STATES = ("completed", "partial", "failed", "cancelled")


class CallsView:
    """Reads (owns nothing): the journal's file through a connection of its
    own, the live calls, and the pool's liveness rows."""

    def __init__(self, journal_path: str, calls: LiveCalls, pool: Pool) -> None:
        self._path = journal_path
        self._conn: sqlite3.Connection | None = None  # opened at the first `calls`
        self._calls = calls
        self._pool = pool

    def answer(self, user: Identity, query: Calls) -> dict[str, Any]:
        """The `calls_reply` to `query` from `user`. Raises ProtocolError
        (`storage_error`) when the journal cannot be read."""
        try:
            rows, more = self._page(user, query)
            attempts = self._attempts([row["call_id"] for row in rows])
            if query.call_id is not None and rows:
                rows[0]["request"], rows[0]["options"] = self._request(query.call_id)
        except sqlite3.DatabaseError as exc:
            raise ProtocolError(ErrorCode.STORAGE_ERROR,
                                f"the journal cannot be read: {exc}") from None
        for row in rows:
            self._fill(row, attempts.get(row["call_id"], []), full=query.call_id is not None)
        last = rows[-1] if more and rows else None
        return {"v": VERSION, "op": Op.CALLS_REPLY.value, "ref": query.ref, "calls": rows,
                "next": None if last is None else calls_cursor(last["created"], last["call_id"])}

    @property
    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            self._conn = sqlite3.connect(self._path, isolation_level=None,
                                         check_same_thread=False)
        return self._conn

    def _page(self, user: Identity, q: Calls) -> tuple[list[dict[str, Any]], bool]:
        where: list[str] = ["state != 'staging'"]
        params: list[object] = []
        owner = q.identity if user.is_admin else user.name
        if not user.is_admin and q.identity not in (None, user.name):
            return [], False  # another identity's calls: none, for a client
        for clause, value in (("owner = ?", owner), ("provider = ?", q.provider),
                              ("call_id = ?", q.call_id)):
            if value is not None:
                where.append(clause)
                params.append(value)
        if q.state == "live":
            where.append("state != 'done'")
        elif q.state == "done":
            where.append("state = 'done'")
        elif q.state in _STATUS_STATES:
            where.append("state = 'done' AND status = ?")
            params.append(q.state)
        if q.search is not None:
            n = len(q.search)
            where.append("(substr(call_id, 1, ?) = ? OR substr(session_id, 1, ?) = ?)")
            params += [n, q.search, n, q.search]
        if q.before is not None:
            where.append("(created < ? OR (created = ? AND call_id < ?))")
            params += [q.before[0], q.before[0], q.before[1]]
        sql = (f"{_SELECT} WHERE {' AND '.join(where)} ORDER BY created DESC, call_id DESC "
               "LIMIT ?")
        found = self._db.execute(sql, (*params, q.limit + 1)).fetchall()
        return [dict(zip(_ROW, row, strict=True)) for row in found[:q.limit]], \
            len(found) > q.limit

    def _attempts(self, call_ids: list[str]) -> dict[str, list[dict[str, Any]]]:
        by_call: dict[str, list[dict[str, Any]]] = {}
        if call_ids:
            sql = _ATTEMPTS.format(", ".join("?" * len(call_ids)))
            for row in self._db.execute(sql, call_ids):
                by_call.setdefault(row[0], []).append(dict(zip(_ATTEMPT, row[1:], strict=True)))
        return by_call

    def _request(self, call_id: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """One call's request and options as journaled (a large request kept as
        a file: nil; its size is what its submit said)."""
        row = self._db.execute("SELECT request, options, in_file FROM requests WHERE call_id = ?",
                               (call_id,)).fetchone()
        if row is None:
            return None, None
        options = msgpack.unpackb(row[1], raw=False)
        return (None if row[2] else msgpack.unpackb(row[0], raw=False)), options

    def _fill(self, row: dict[str, Any], attempts: list[dict[str, Any]], full: bool) -> None:
        """The row's state as a client would name it (a live call's from the
        driver), and its figures from its attempts: the first chunk's time and
        the visible characters of the answer that stands (its last attempt's,
        with those it was rebound from), the chunks of a running attempt read
        live."""
        call = self._calls.get(row["call_id"])
        if call is not None:
            row["state"], row["attempts"] = call.state.value, call.attempts
        elif row["state"] != "done":
            row["state"] = "queued" if row["state"] == "pending" else row["state"]
        else:
            row["state"] = row["status"] or "done"
        chars = 0
        for attempt in reversed(attempts):
            chars += attempt["chars"] or 0
            if attempt["how"] != "rebound":
                break
        row["chars"] = chars
        row["first_chunk_ms"] = next((a["first_chunk_ms"] for a in reversed(attempts)
                                      if a["first_chunk_ms"] is not None), None)
        running = attempts[-1] if attempts and attempts[-1]["ended"] is None else None
        if call is not None and running is not None:
            worker = self._pool.get(call.worker_id)
            if worker is not None:
                token, _, chunks, nbytes = self._pool.liveness(worker)
                if token == call.token:
                    running["chunks"], running["bytes"] = chunks, nbytes
        row["chunks"] = sum(a["chunks"] or 0 for a in attempts)
        del row["status"]
        if full:
            row["attempt_rows"] = attempts

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
