"""One record is one line of the daemon's text log, whatever a client sent
(supervisor/logs.py): a session id or a model name holding a newline, a
carriage return or an escape sequence is written escaped, and a session id
cannot forge a `call=` field. Through the formatter, and through the real
daemon and its real worker (the model name is logged by the worker)."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamfence.devtools.emulator.control import EmulatorProcess
from streamfence.supervisor.logs import TextFormatter
from tests.harness import DaemonProcess, wait_until
from tests.wires import profiles_for

FORGED = "2026-01-01 00:00:00,000 CRITICAL supervisor[1] streamfence.supervisor: FORGED"


def _text(emit_args: tuple[object, ...], **context: object) -> str:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(TextFormatter())
    logger = logging.getLogger("tests.log_escaping")
    logger.propagate, logger.handlers[:] = False, [handler]
    logger.setLevel(logging.INFO)
    extra = {"session_id": None, "call_id": None, "attempt": None, **context}
    logger.info(*emit_args, extra=extra)
    return stream.getvalue()


def test_a_newline_in_a_context_field_or_the_message_stays_on_its_line() -> None:
    text = _text(("attempt started: model=%s", "m\n" + FORGED),
                 session_id="s\r\n" + FORGED, call_id="c1", attempt=1)
    assert text.count("\n") == 1, text  # one record, one line
    assert 'session="s\\r\\n2026-01-01' in text, text
    assert "model=m\\n2026-01-01" in text, text


def test_a_session_id_cannot_forge_another_field() -> None:
    text = _text(("hello",), session_id="x call=forged", call_id="real")
    assert ' session="x call=forged" call=real: hello' in text, text
    plain = _text(("hello",), session_id="sess-1", call_id="c2", attempt=2)
    assert " session=sess-1 call=c2 attempt=2: hello\n" in plain, plain


def test_escape_sequences_and_bidi_overrides_are_escaped() -> None:
    text = _text(("model=%s", "\x1b[2J\u202egpt\u2028x"))
    assert "model=\\x1b[2J\\u202egpt\\u2028x\n" in text, text
    assert "é and 中文 stay" in _text(("é and 中文 stay",))


@pytest.fixture(scope="module")
def text_daemon(tmp_path_factory: pytest.TempPathFactory,
                emulator: EmulatorProcess) -> Iterator[DaemonProcess]:
    proc = DaemonProcess(tmp_path_factory.mktemp("log_escaping") / "state",
                         profiles_for(emulator, {"emu": "openai"}), log_json=False)
    try:
        yield proc.start()
    finally:
        proc.cleanup()


@pytest.mark.slow
def test_the_daemons_text_log_keeps_a_forged_line_on_its_own(text_daemon: DaemonProcess,
                                                             tmp_path: Path) -> None:
    model = "emu-model#escape\n" + FORGED + " model"
    with text_daemon.client() as client:
        call_id = client.submit("emu", {"model": model, "messages": [
            {"role": "user", "content": "hi"}]}, session_id="sess\n" + FORGED + " session",
            subscribe=False)
        done = client.result(call_id, wait_s=30.0)
    assert done is not None and done["status"] in ("completed", "failed"), done

    def logged() -> list[str] | None:
        lines = [line for line in text_daemon.log_text().splitlines() if call_id in line]
        started = [line for line in lines if "attempt started" in line]
        return lines if started else None

    lines = wait_until(logged, 10, f"the worker's `attempt started` line of {call_id}")
    log = text_daemon.log_text()
    assert not any(line.startswith(FORGED) for line in log.splitlines()), log[-3000:]
    started = next(line for line in lines if "attempt started" in line)
    assert '"sess\\n2026-01-01' in started and "#escape\\n2026-01-01" in started, started
