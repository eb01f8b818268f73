"""The pieces of the operator's log, as units (docs/ARCHITECTURE.md §4.9; the
real daemon's log is tests/test_logging_e2e.py): context fields only when
set, httpx2's request lines at DEBUG, a traceback carried from a worker to
the supervisor's last line of a call (where it was raised, never what the
exception said), and a worker's one WARNING line per failed attempt."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest
import zmq

from streamfence.protocol.internal import L_RECORD
from streamfence.protocol.internal.outcome import (
    AttemptError,
    AttemptOutcome,
    BadOutcome,
    ErrorClass,
    outcome_from_wire,
    outcome_to_wire,
)
from streamfence.protocol.logs import DEMOTED_LOGGERS, set_level
from streamfence.supervisor.logs import (
    JsonFormatter,
    TextFormatter,
    drain_child_logs,
    emit_child_record,
    log_with_traceback,
)
from streamfence.workers import worker
from streamfence.workers.errors import TRACEBACK_LIMIT, classify, traceback_text
from tests.harness import wait_until


class _Recorder(logging.Handler):
    """A handler that keeps the records it is handed, in `seen`."""

    def __init__(self, seen: list[logging.LogRecord]) -> None:
        super().__init__()
        self.seen = seen

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(record)


def _record(**context: Any) -> logging.LogRecord:
    fields = {"name": "streamfence.x", "levelno": logging.INFO, "levelname": "INFO",
              "msg": "hello", "processName": "MainProcess", "process": 1}
    return logging.makeLogRecord({**fields, **context})


@pytest.mark.parametrize(("context", "shown"), [
    ({}, ""),
    ({"session_id": None, "call_id": None, "attempt": None}, ""),
    ({"session_id": None, "call_id": "c1", "attempt": 2}, " call=c1 attempt=2"),
    ({"session_id": "s1", "call_id": "c1", "attempt": 1}, " session=s1 call=c1 attempt=1"),
])
def test_text_lines_show_only_the_context_that_is_set(context: dict[str, Any],
                                                      shown: str) -> None:
    line = TextFormatter().format(_record(**context))
    assert line.endswith(f" MainProcess[1] streamfence.x{shown}: hello"), line
    assert "=-" not in line and "attempt=0" not in line


def test_json_lines_leave_unset_context_out() -> None:
    none = json.loads(JsonFormatter().format(_record(session_id=None, call_id=None,
                                                     attempt=None)))
    assert not {"session_id", "call_id", "attempt"} & none.keys(), none
    some = json.loads(JsonFormatter().format(_record(session_id=None, call_id="c1",
                                                     attempt=3)))
    assert (some["call_id"], some["attempt"]) == ("c1", 3) and "session_id" not in some


def test_a_call_line_names_its_identity_in_text_and_every_field_in_json() -> None:
    context = {"identity": "alice", "session_id": "s1", "call_id": "c1", "attempt": 2,
               "provider": "openai", "model": "gpt-4o",
               "fields": {"status": "completed", "finish_reason": "stop"}}
    line = TextFormatter().format(_record(**context))
    assert line.endswith(" streamfence.x identity=alice session=s1 call=c1 attempt=2: hello"), \
        line
    record = json.loads(JsonFormatter().format(_record(**context)))
    expected = {k: v for k, v in context.items() if k != "fields"}
    expected.update(status="completed", finish_reason="stop")
    assert {k: record.get(k) for k in expected} == expected, record
    assert "fields" not in record


def test_a_child_record_is_printed_at_the_time_the_child_created_it() -> None:
    created = 1_700_000_000.25
    seen: list[logging.LogRecord] = []
    logger = logging.getLogger("tests.operator_logs.child")
    logger.propagate, logger.handlers[:] = False, [_Recorder(seen)]
    emit_child_record({"name": logger.name, "levelno": logging.INFO, "levelname": "INFO",
                       "msg": "from a worker", "created": created})
    stamp = TextFormatter().formatTime(seen[0])
    assert seen[0].created == created and stamp.endswith(",250"), stamp


def test_a_batch_of_child_records_is_written_in_the_order_they_were_created() -> None:
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    seen: list[logging.LogRecord] = []
    logger = logging.getLogger("tests.operator_logs.batch")
    logger.propagate, logger.handlers[:] = False, [_Recorder(seen)]
    try:
        pull.bind("inproc://logs")
        push.connect("inproc://logs")
        for name, created in (("b", 2.0), ("c", 3.0), ("a", 1.0)):
            push.send(msgpack.packb([L_RECORD, {"name": logger.name, "levelno": logging.INFO,
                                                "levelname": "INFO", "msg": name,
                                                "created": created}]))
        wait_until(lambda: pull.poll(0) != 0, 5, "the records on the socket")
        drain_child_logs(pull)
    finally:
        pull.close(0)
        push.close(0)
        ctx.term()
    assert [r.getMessage() for r in seen] == ["a", "b", "c"]


@pytest.fixture
def levels() -> Iterator[list[logging.LogRecord]]:
    """Records reaching a handler of httpx2's logger; the levels restored after."""
    root = logging.getLogger()
    saved = root.level, {n: logging.getLogger(n).level for n in DEMOTED_LOGGERS}
    seen: list[logging.LogRecord] = []
    handler = _Recorder(seen)
    logging.getLogger("httpx2").addHandler(handler)
    try:
        yield seen
    finally:
        logging.getLogger("httpx2").removeHandler(handler)
        root.setLevel(saved[0])
        for name, level in saved[1].items():
            logging.getLogger(name).setLevel(level)


def test_httpx2_request_lines_are_debug(levels: list[logging.LogRecord]) -> None:
    set_level("INFO")
    logging.getLogger("httpx2").info("HTTP Request: POST http://127.0.0.1:1/v1 200")
    logging.getLogger("httpx2").warning("a warning stays one")
    assert [(r.levelname, r.getMessage()) for r in levels] == [("WARNING", "a warning stays one")]
    levels.clear()
    set_level(logging.DEBUG)
    logging.getLogger("httpx2").info("HTTP Request: POST http://127.0.0.1:1/v1 200")
    assert [(r.levelno, r.levelname) for r in levels] == [(logging.DEBUG, "DEBUG")]


def _formatted(formatter: logging.Formatter, emit: Any) -> str:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    logger = logging.getLogger("tests.operator_logs")
    logger.propagate, logger.handlers[:] = False, [handler]
    logger.setLevel(logging.INFO)
    emit(logger)
    return stream.getvalue()


def test_a_traceback_from_a_worker_is_logged_as_the_records_own() -> None:
    tb = "Traceback (most recent call last):\n  File \"w.py\", line 1, in f\nKeyError"
    ctx = {"session_id": None, "call_id": "c1", "attempt": 2}

    def emit(logger: logging.Logger) -> None:
        log_with_traceback(logger, logging.ERROR, tb, "call failed after %d attempt(s)", 2,
                           context=ctx)
        log_with_traceback(logger, logging.ERROR, None, "no traceback", context=ctx)
        log_with_traceback(logger, logging.DEBUG, tb, "below the level", context=ctx)

    text = _formatted(TextFormatter(), emit)
    assert " call=c1 attempt=2: call failed after 2 attempt(s)\n" + tb + "\n" in text, text
    assert text.count("Traceback") == 1 and "below the level" not in text
    lines = [json.loads(line) for line in _formatted(JsonFormatter(), emit).splitlines()]
    assert [r.get("traceback") for r in lines] == [tb, None], lines
    assert lines[0]["level"] == "ERROR" and lines[0]["call_id"] == "c1"


def test_the_outcome_carries_a_traceback_and_checks_it() -> None:
    error = AttemptError(ErrorClass.FINAL, "unexpected_error", "KeyError: 'x'", traceback="tb")
    outcome = AttemptOutcome(ok=False, error=error)
    assert outcome_from_wire(outcome_to_wire(outcome)) == outcome
    plain = AttemptOutcome(ok=False, error=AttemptError(ErrorClass.TRANSIENT, "c", "m"))
    assert outcome_from_wire(outcome_to_wire(plain)) == plain
    bad = outcome_to_wire(outcome)
    bad[7][5] = 12
    with pytest.raises(BadOutcome):
        outcome_from_wire(bad)


def _raise_chained(key: str, request: dict[str, Any]) -> None:
    nothing: dict[str, Any] = {}
    try:
        nothing[key]
    except KeyError as exc:
        raise ValueError(f"the request: {request}") from exc


def test_traceback_text_says_where_not_what() -> None:
    # Runtime data (a credential, a prompt) is in the exceptions' text, never
    # in the frames' source lines: the text is left out.
    secret, prompt = f"sk-live-{12345 * 11}", " ".join(["the", "user's", "prompt"])
    with pytest.raises(ValueError) as info:
        _raise_chained(secret, {"content": prompt})
    text = traceback_text(info.value)
    assert text.startswith("Traceback (most recent call last):\n")
    assert "in _raise_chained" in text
    assert "\nKeyError (its text is left out)\n" in text
    assert "direct cause of the following exception" in text
    assert text.endswith("\nValueError (its text is left out)")
    assert secret not in text and prompt not in text, text


def test_traceback_text_keeps_the_end_of_a_long_one() -> None:
    exc: BaseException | None = None
    for n in range(300):  # a chain of 300 exceptions, each with its own traceback
        try:
            raise RuntimeError(n) from exc
        except RuntimeError as caught:
            exc = caught
    assert exc is not None
    text = traceback_text(exc)
    assert len(text) <= TRACEBACK_LIMIT + 40
    assert re.match(r"… \(\d+ characters cut\)\n", text), text[:100]
    assert text.endswith("RuntimeError (its text is left out)")


def _failed(exc: BaseException, visible: bool = False) -> tuple[AttemptOutcome,
                                                                 list[logging.LogRecord]]:
    error = classify(exc)
    out = SimpleNamespace(visible=visible, exc=exc)
    seen: list[logging.LogRecord] = []
    handler = _Recorder(seen)
    log = logging.getLogger("streamfence.worker")
    log.addHandler(handler)
    try:
        outcome = worker._failed(AttemptOutcome(ok=False, error=error), error, out)  # type: ignore[arg-type]
    finally:
        log.removeHandler(handler)
    return outcome, [r for r in seen if r.levelno >= logging.INFO]


def test_a_failed_attempt_is_one_warning_and_only_the_unexpected_carry_a_traceback() -> None:
    try:
        raise TypeError("Missing required arguments")
    except TypeError as exc:
        outcome, lines = _failed(exc)
    assert outcome.error is not None and outcome.error.code == "unexpected_error"
    assert outcome.error.traceback is not None
    assert outcome.error.traceback.endswith("TypeError (its text is left out)")
    assert [(r.levelname, r.exc_info, r.getMessage()) for r in lines] == [
        ("WARNING", None, "stream failed before delivery: TypeError: Missing required "
                          "arguments (final, unexpected_error)")]
    try:
        raise ConnectionResetError("reset by peer")
    except ConnectionResetError as exc:
        outcome, lines = _failed(exc, visible=True)
    assert outcome.error is not None and outcome.error.traceback is None
    assert [r.getMessage().split(":")[0] for r in lines] == ["stream failed after visible text"]
