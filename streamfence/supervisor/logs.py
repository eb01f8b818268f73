"""The daemon's one log stream: its own records and every child's, plain text
or JSON lines. A record's session_id, call_id and attempt appear only when
set: `session=… call=… attempt=…` before the message in text, keys in JSON
(a line of no call has none of them)."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from streamfence.protocol.logs import CONTEXT_FIELDS, ContextFilter, set_level

TEXT_FORMAT = ("%(asctime)s %(levelname)-7s %(processName)s[%(process)d] %(name)s"
               "%(context)s: %(message)s")
_LABELS = {"session_id": "session", "call_id": "call", "attempt": "attempt"}


def context_of(record: logging.LogRecord) -> dict[str, Any]:
    """The record's context fields that are set (None, "" and 0 are unset)."""
    return {key: value for key in CONTEXT_FIELDS if (value := getattr(record, key, None))}


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        record.context = "".join(f" {_LABELS[key]}={value}"
                                 for key, value in context_of(record).items())
        return super().format(record)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": record.created, "level": record.levelname, "logger": record.name,
            "process": record.process, "process_name": record.processName,
            "message": record.getMessage(),
        }
        out.update(context_of(record))
        exc = record.exc_text or (self.formatException(record.exc_info)
                                  if record.exc_info else None)
        if exc:
            out["traceback"] = exc
        return json.dumps(out, default=str)


def setup_logging(level: str, json_lines: bool, stream: Any = None) -> None:
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
    """Re-emit a record that a child process sent, through our handlers."""
    record = logging.makeLogRecord(fields)
    record.args = None
    logging.getLogger(record.name).handle(record)
