"""Log records on the wire: the process log context, the levels every
process applies, and the handler that ships a child process's records
(workers, sink, gateway) to the daemon's one log.

Every record of every process carries the call context, CONTEXT_FIELDS:
`identity` (who submitted the call), `session_id`, `call_id`, `attempt`
(origin document 000: the one line that explains a failed stream must name
its session and its caller), `provider` (the profile) and `model` (as the
request names it); each is None when unset (a record of no call, a call
without a session), and the daemon's log leaves an unset one out. A worker
runs one attempt at a time, so the context is simply process-global: it
holds for records from any thread and any library (the openai SDK's,
httpx2's), which a thread-local or contextvar would not. The supervisor's
records of a call carry its context as `extra` (supervisor/livecalls.py
`call_context`).

A record may also carry `fields` (`extra={"fields": {...}}`): a map of
structured values that JSON logs write as keys of their own (the text log
has them in the message already): a call's `status` and `finish_reason`,
a refusal's `code`, the gateway's access lines' HTTP fields.

Each record keeps the time it was created in its own process (`created`,
shipped as it is): the daemon's log prints that time, so lines of
different processes, which reach the log through different pipes, may
come out of order but each says when it happened.

httpx2 logs every request at INFO (`HTTP Request: POST … "HTTP/1.1 200
OK"`): the warm-ups' requests to a stub on a random local port, and one per
attempt, which the daemon's own lines (`attempt started`, a failure with its
status) already tell. `set_level` makes those lines DEBUG in every process:
not even created below DEBUG, and at DEBUG shown as DEBUG.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

import msgpack
import zmq

from streamfence.protocol.internal import L_RECORD

CONTEXT_FIELDS = ("identity", "session_id", "call_id", "attempt", "provider", "model")
_context: dict[str, Any] = dict.fromkeys(CONTEXT_FIELDS)

# Libraries whose INFO records are DEBUG in the daemon's log (see the module docstring).
DEMOTED_LOGGERS = ("httpx2",)


def set_context(session_id: str | None, call_id: str | None, attempt: int | None,
                identity: str | None = None, provider: str | None = None,
                model: str | None = None) -> None:
    """This process's call context (a worker's attempt); "" and 0 are unset."""
    _context.update(identity=identity or None, session_id=session_id or None,
                    call_id=call_id or None, attempt=attempt or None,
                    provider=provider or None, model=model or None)


def clear_context() -> None:
    _context.update(dict.fromkeys(CONTEXT_FIELDS))


def request_model(request: Mapping[str, Any]) -> str | None:
    """The model a request names, for log lines (Bedrock names it `modelId`)."""
    model = request.get("model") or request.get("modelId")
    return model if isinstance(model, str) else None


class _InfoIsDebug(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.INFO:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


_INFO_IS_DEBUG = _InfoIsDebug()


def set_level(level: int | str) -> None:
    """This process's log level, with the DEMOTED_LOGGERS' INFO records at DEBUG."""
    root = logging.getLogger()
    root.setLevel(level)
    debug = root.getEffectiveLevel() <= logging.DEBUG
    for name in DEMOTED_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(logging.NOTSET if debug else logging.WARNING)
        logger.addFilter(_INFO_IS_DEBUG)  # once: addFilter skips a filter it holds


class ContextFilter(logging.Filter):
    """Stamps the process context on every record that does not carry its own
    (a record logged with extra={"call_id": ...} keeps its own). A filter on
    the handler, not a record factory, so that `extra` may still set them."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key in CONTEXT_FIELDS:
            if not hasattr(record, key):
                setattr(record, key, _context[key])
        return True


class ZmqLogHandler(logging.Handler):
    """Sends each record as a msgpack map over a PUSH socket to the supervisor.

    The record is flattened to plain fields (message formatted, traceback as
    text): no pickle on any socket.
    """

    def __init__(self, socket: zmq.Socket[bytes], process_name: str) -> None:
        super().__init__()
        self.addFilter(ContextFilter())
        self._socket = socket
        self._process_name = process_name
        self._lock_send = threading.Lock()
        self._formatter = logging.Formatter()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            exc_text = record.exc_text
            if record.exc_info and not exc_text:
                exc_text = self._formatter.formatException(record.exc_info)
            fields = {
                "name": record.name,
                "levelno": record.levelno,
                "levelname": record.levelname,
                "msg": record.getMessage(),
                "exc_text": exc_text,
                "created": record.created,
                "process": record.process,
                "processName": self._process_name,
            }
            for key in CONTEXT_FIELDS:
                fields[key] = getattr(record, key, _context[key])
            if (structured := getattr(record, "fields", None)) is not None:
                fields["fields"] = structured
            frame = msgpack.packb([L_RECORD, fields], use_bin_type=True, default=str)
            with self._lock_send:
                self._socket.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            pass  # the supervisor is behind: losing a log line beats blocking a stream
        except Exception:
            self.handleError(record)


def route_logs_to(socket: zmq.Socket[bytes], level: int | str, process_name: str,
                  forked: bool = False) -> None:
    """Make `socket` the only destination of this process's records. `forked`:
    the level is the one the parent set before the fork (a worker: setting it
    again visits every logger, ~1.3 ms and 200 copied pages per worker)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(ZmqLogHandler(socket, process_name))
    if not forked:
        set_level(level)
