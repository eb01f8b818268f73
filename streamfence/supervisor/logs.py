"""The daemon's one log stream: its own records and every child's, with
session_id, call_id and attempt on each line; plain text or JSON lines."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from streamfence.protocol.logs import CONTEXT_FIELDS, ContextFilter

TEXT_FORMAT = ("%(asctime)s %(levelname)-7s %(processName)s[%(process)d] %(name)s "
               "session=%(session_id)s call=%(call_id)s attempt=%(attempt)s: %(message)s")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": record.created, "level": record.levelname, "logger": record.name,
            "process": record.process, "process_name": record.processName,
            "message": record.getMessage(),
        }
        for key in CONTEXT_FIELDS:
            out[key] = getattr(record, key, None)
        exc = record.exc_text or (self.formatException(record.exc_info)
                                  if record.exc_info else None)
        if exc:
            out["traceback"] = exc
        return json.dumps(out, default=str)


def setup_logging(level: str, json_lines: bool, stream: Any = None) -> None:
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonFormatter() if json_lines else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def emit_child_record(fields: dict[str, Any]) -> None:
    """Re-emit a record that a child process sent, through our handlers."""
    record = logging.makeLogRecord(fields)
    record.args = None
    logging.getLogger(record.name).handle(record)
