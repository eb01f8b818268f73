"""The daemon's one log stream: its own records and every child's, plain text
or JSON lines, on stderr or in a file rotated by size (`log_file`). A
record's call context (protocol/logs.py CONTEXT_FIELDS) appears only when
set: `identity=… session=… call=… attempt=…` before the message in text
(the provider and the model are in the messages that are about them), keys
in JSON (a line of no call has none of them). A record's `fields`
(protocol/logs.py) are keys of their own in JSON, after the ones above,
which they never replace.

Every line's time is its record's own `created`, stamped in the process
that logged it. A batch of child records read at once is written in the
order they were created; records that reach the supervisor by different
paths (its own, the zygote's pipe, the log socket) are written as they
arrive, so lines of different processes may still come a few milliseconds
out of order: sort on the time (JSON `ts`) to read them in order.

Clients choose some of what is logged (a session id, a model name), so the
text format escapes it: one record is one line, whatever a client sent. In
the message, each character that is not printable (a newline, a carriage
return, an ANSI escape, a bidirectional override) is written as its Python
escape (`\n`, `\x1b`, `\u202e`); a context value holding any of those, a
space, `=` or `"` is written as a JSON string, so no one forges a `call=`
either. A traceback's lines follow its record's line as they always did
(a worker's tracebacks leave the exceptions' text out: workers/errors.py).
JSON lines are escaped by the encoder."""

from __future__ import annotations

import json
import logging
import logging.handlers
import sys
from typing import Any

import msgpack
import zmq

from streamfence.protocol.internal import L_RECORD
from streamfence.protocol.logs import CONTEXT_FIELDS, ContextFilter, set_level

TEXT_FORMAT = ("%(asctime)s %(levelname)-7s %(processName)s[%(process)d] %(name)s"
               "%(context)s: %(message)s")
# The context fields the text format shows, with their labels, in this order.
_LABELS = {"identity": "identity", "session_id": "session", "call_id": "call",
           "attempt": "attempt"}


def context_of(record: logging.LogRecord) -> dict[str, Any]:
    """The record's context fields that are set (None, "" and 0 are unset)."""
    return {key: value for key in CONTEXT_FIELDS if (value := getattr(record, key, None))}


_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_char(c: str) -> str:
    code = ord(c)
    if c in _ESCAPES:
        return _ESCAPES[c]
    return f"\\x{code:02x}" if code < 0x100 else (
        f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")


def escape_text(text: str) -> str:
    """`text` on one line: each character that is not printable as its escape."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape_char(c) for c in text)


def _context_value(value: Any) -> str:
    text = str(value)
    if text.isprintable() and not any(c in text for c in ' ="'):
        return text
    return json.dumps(text)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        record.context = "".join(f" {label}={_context_value(value)}"
                                 for key, label in _LABELS.items()
                                 if (value := getattr(record, key, None)))
        return super().format(record)

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape_text(record.message)
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": record.created, "level": record.levelname, "logger": record.name,
            "process": record.process, "process_name": record.processName,
            "message": record.getMessage(),
        }
        out.update(context_of(record))
        fields = getattr(record, "fields", None)
        for key, value in (fields.items() if isinstance(fields, dict) else ()):
            out.setdefault(key, value)
        exc = record.exc_text or (self.formatException(record.exc_info)
                                  if record.exc_info else None)
        if exc:
            out["traceback"] = exc
        return json.dumps(out, default=str)


def setup_logging(level: str, json_lines: bool, stream: Any = None, log_file: str = "",
                  max_bytes: int = 0, backups: int = 0) -> None:
    """The daemon's one handler: `log_file` if set (a new file once it holds
    `max_bytes`, keeping `backups` old ones: FILE.1 the newest), else
    `stream` (stderr)."""
    handler: logging.Handler
    if log_file:
        handler = logging.handlers.RotatingFileHandler(
            log_file, maxBytes=max_bytes, backupCount=backups, encoding="utf-8")
    else:
        handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonFormatter() if json_lines else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    set_level(level)


def log_with_traceback(logger: logging.Logger, level: int, traceback: str | None, msg: str,
                       *args: Any, context: dict[str, Any]) -> None:
    """Log `msg % args` with a traceback text that came from another process
    (an attempt's unexpected exception, carried in its outcome), as a record
    logged with exc_info carries its own: after the message in text, the
    `traceback` key in JSON."""
    if not logger.isEnabledFor(level):
        return
    record = logger.makeRecord(logger.name, level, "", 0, msg, args, None, extra=context)
    record.exc_text = traceback
    logger.handle(record)


def emit_child_record(fields: dict[str, Any]) -> None:
    """Re-emit a record that a child process sent, through our handlers, at
    the time the child created it."""
    record = logging.makeLogRecord(fields)
    record.args = None
    # makeLogRecord stamped now and then took the child's `created`: its
    # milliseconds (the text format's ",mmm") must be the child's too.
    record.msecs = int((record.created - int(record.created)) * 1000) + 0.0
    logging.getLogger(record.name).handle(record)


def drain_child_logs(logs: zmq.Socket[bytes]) -> None:
    """Re-emit every record the children sent that waits on `logs` (PULL),
    in the order they were created (the children's pipes interleave)."""
    batch: list[dict[str, Any]] = []
    while True:
        try:
            frame = logs.recv(zmq.NOBLOCK)
        except zmq.Again:
            break
        msg = msgpack.unpackb(frame, raw=False)
        if msg and msg[0] == L_RECORD and isinstance(msg[1], dict):
            batch.append(msg[1])
    batch.sort(key=_created)
    for fields in batch:
        emit_child_record(fields)


def _created(fields: dict[str, Any]) -> float:
    created = fields.get("created")
    return float(created) if isinstance(created, int | float) else 0.0
