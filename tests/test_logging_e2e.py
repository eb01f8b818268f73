"""The daemon's log as an operator reads it, and its processes as `ps` shows
them (docs/ARCHITECTURE.md §4.9), through the real daemon and its real
children, one daemon for the whole module (at DEBUG, for the SDKs' records):

- every record a worker emits, the SDK's and httpx2's own included, carries
  the call's session_id, call_id and attempt; httpx2's per-request lines are
  DEBUG; a record of no call has none of those fields;
- every line of a call, the supervisor's and its worker's, names the
  identity that submitted it, the call, its provider and its model as JSON
  keys; its last line has its status and finish_reason as keys;
- each submit has one access line (`streamfence.front.access`), accepted,
  duplicate or refused with its code;
- a failed call logs exactly one ERROR, with the traceback of its last
  attempt's unexpected exception if one ended it; each failed attempt logs
  one WARNING without a traceback; a call that failed an attempt and then
  completed logs no ERROR;
- the supervisor, the sink, the zygote and each worker have their own process
  title, a busy worker's naming its call and attempt.
"""

from __future__ import annotations

from typing import Any

import psutil
import pytest

from streamfence.devtools.emulator.control import EmulatorClient
from streamfence.protocol.client import ClientError
from tests.harness import DaemonProcess, wait_until
from tests.wires import DaemonFactory

pytestmark = pytest.mark.slow

HELLO = [{"role": "user", "content": "x"}]


@pytest.fixture(scope="module")
def daemon(module_daemon: DaemonFactory) -> DaemonProcess:
    return module_daemon({"emu": "openai", "bedrock": "bedrock"}, daemon={"log_level": "DEBUG"})


def _run(daemon: DaemonProcess, provider: str, request: dict[str, Any],
         session_id: str | None = None, **options: Any) -> tuple[str, dict[str, Any]]:
    with daemon.client() as client:
        call_id = client.submit(provider, request, session_id=session_id, options=options)
        done = list(client.events(call_id, timeout_s=30.0))[-1]
    return call_id, done


def _records(daemon: DaemonProcess, call_id: str) -> list[dict[str, Any]]:
    return [r for r in daemon.log_records() if r.get("call_id") == call_id]


def _all_logged(daemon: DaemonProcess, call_id: str, attempts: int) -> list[dict[str, Any]]:
    """The call's records once the last ones are in: the supervisor's last line
    and each attempt's `attempt ended` line (records reach the log through the
    supervisor, in their order per process, not all at once)."""
    def complete() -> list[dict[str, Any]] | None:
        records = _records(daemon, call_id)
        ended = sum(1 for r in records if r["message"].startswith("attempt ended"))
        last = any(r["logger"] == "streamfence.attempts" and r["message"].startswith("call ")
                   for r in records)
        return records if last and ended >= attempts else None

    records = wait_until(complete, 10, f"the log lines of call {call_id}")
    assert records is not None
    return records


def test_worker_records_carry_the_call_context(daemon: DaemonProcess,
                                               emu: EmulatorClient) -> None:
    call_id, done = _run(daemon, "emu", {"model": "gpt-emu#ctx", "messages": HELLO},
                         session_id="sess-logging-1")
    assert done["status"] == "completed", done
    records = _all_logged(daemon, call_id, 1)
    worker = [r for r in records if str(r.get("process_name")).startswith("worker-")]
    sdk = [r for r in worker if r["logger"].split(".")[0] in ("httpx2", "openai")]
    assert any(r["logger"] == "httpx2" for r in sdk), worker
    for record in worker:
        assert record["session_id"] == "sess-logging-1", record
        assert record["attempt"] == 1, record
    # httpx2's per-request line ("HTTP Request: POST …") is DEBUG, not INFO.
    requests = [r for r in sdk if r["message"].startswith("HTTP Request:")]
    assert requests and all(r["level"] == "DEBUG" for r in requests), requests


def test_a_record_of_no_call_has_no_context_fields(daemon: DaemonProcess) -> None:
    ready = [r for r in daemon.log_records() if r["message"].startswith("ready:")]
    warmup = [r for r in daemon.log_records() if r.get("process_name") == "zygote"]
    assert ready and warmup
    for record in ready + warmup:
        assert not {"session_id", "call_id", "attempt"} & record.keys(), record
    # The zygote's warm-up requests (to a stub on a random local port) are DEBUG.
    assert all(r["level"] == "DEBUG" for r in warmup if r["logger"] == "httpx2"), warmup


def test_a_failed_call_logs_one_error_with_the_traceback_of_its_unexpected_exception(
        daemon: DaemonProcess) -> None:
    # A request the daemon admits but botocore refuses (a Converse message's
    # content must be a list): ParamValidationError, which no rule classifies,
    # so it is an unexpected exception of the worker (final: one attempt).
    request = {"modelId": "m#unexpected",
               "messages": [{"role": "user", "content": "a prompt, never in a traceback"}]}
    call_id, done = _run(daemon, "bedrock", request, session_id="sess-logging-2")
    assert done["status"] == "failed", done
    records = _all_logged(daemon, call_id, 1)
    errors = [r for r in records if r["level"] in ("ERROR", "CRITICAL")]
    assert len(errors) == 1, errors
    error = errors[0]
    assert error["process_name"] == "MainProcess" and error["attempt"] == 1, error
    assert error["message"].startswith("call failed after 1 attempt(s): provider_error: "
                                       "ParamValidationError"), error
    tb = error["traceback"]
    assert tb.startswith("Traceback (most recent call last)"), tb
    assert "bedrock_converse.py" in tb and "botocore.exceptions.ParamValidationError" in tb
    assert "a prompt" not in tb  # frames and types only, no exception text
    attempt = [r for r in records if r["level"] == "WARNING"]
    assert len(attempt) == 1 and "stream failed before delivery" in attempt[0]["message"]
    assert [r for r in records if "traceback" in r] == [error], records
    started = [r["message"] for r in records if r["message"].startswith("attempt started")]
    assert started == ["attempt started: provider=bedrock model=m#unexpected"], started


def test_a_call_that_fails_every_attempt_logs_one_error(daemon: DaemonProcess,
                                                        emu: EmulatorClient) -> None:
    emu.script("fails", [{"fault": "status", "status": 500, "message": "emulated outage"}] * 3)
    call_id, done = _run(daemon, "emu", {"model": "gpt-emu#fails", "messages": HELLO},
                         max_attempts=3)
    assert done["status"] == "failed", done
    records = _all_logged(daemon, call_id, 3)
    errors = [r for r in records if r["level"] in ("ERROR", "CRITICAL")]
    assert len(errors) == 1, errors
    assert "3 attempt(s) failed; last: Error code: 500 - emulated outage" in \
        errors[0]["message"]
    # An SDK's status error is no unexpected exception: its line says it all.
    assert "traceback" not in errors[0]
    warnings = [r for r in records if r["level"] == "WARNING"]
    assert [r["attempt"] for r in warnings] == [1, 2, 3], warnings
    assert all("(transient, server_error)" in r["message"] and "traceback" not in r
               for r in warnings), warnings
    assert "session_id" not in errors[0]  # submitted without a session


def test_a_retried_then_completed_call_logs_no_error(daemon: DaemonProcess,
                                                     emu: EmulatorClient) -> None:
    emu.script("retried", [{"fault": "status", "status": 503, "message": "busy"},
                           {"fault": "ok"}])
    call_id, done = _run(daemon, "emu", {"model": "gpt-emu#retried", "messages": HELLO})
    assert done["status"] == "completed" and done["attempts"] == 2, done
    records = _all_logged(daemon, call_id, 2)
    assert not [r for r in records if r["level"] in ("ERROR", "CRITICAL")], records
    warnings = [r for r in records if r["level"] == "WARNING"]
    assert len(warnings) == 1 and warnings[0]["attempt"] == 1, warnings
    assert "stream failed before delivery: Error code: 503 - busy" in warnings[0]["message"]
    assert not [r for r in records if "traceback" in r], records


def _access_lines(daemon: DaemonProcess, count: int, **match: Any) -> list[dict[str, Any]]:
    """The access lines whose keys have the values `match` has, once there are `count`."""
    def found() -> list[dict[str, Any]] | None:
        lines = [r for r in daemon.log_records() if r["logger"] == "streamfence.front.access"
                 and all(r.get(k) == v for k, v in match.items())]
        return lines if len(lines) >= count else None

    lines = wait_until(found, 10, f"{count} access line(s) with {match}")
    assert lines is not None
    return lines


def test_each_submit_has_one_access_line(daemon: DaemonProcess) -> None:
    request = {"model": "gpt-emu#access", "messages": HELLO}
    with daemon.client() as client:
        call_id = client.submit("emu", request, session_id="sess-access",
                                idempotency_key="access-1", subscribe=False)
        again = client.submit("emu", request, session_id="sess-access",
                              idempotency_key="access-1", subscribe=False)
        with pytest.raises(ClientError) as refused:
            client.submit("nowhere", {"model": "gpt-x", "messages": HELLO}, subscribe=False)
        assert client.result(call_id, wait_s=30.0) is not None
    assert again == call_id and refused.value.code == "unknown_provider"
    accepted, duplicate = _access_lines(daemon, 2, call_id=call_id)
    assert accepted["message"] == "submit accepted provider=emu model=gpt-emu#access", accepted
    assert duplicate["message"] == ("submit accepted (duplicate) provider=emu "
                                    "model=gpt-emu#access"), duplicate
    for line, outcome in ((accepted, "accepted"), (duplicate, "duplicate")):
        assert line["level"] == "INFO" and line["outcome"] == outcome, line
        assert (line["identity"], line["session_id"], line["provider"], line["model"]) == \
            ("local", "sess-access", "emu", "gpt-emu#access"), line
        assert "code" not in line and "attempt" not in line, line
    [line] = _access_lines(daemon, 1, provider="nowhere")
    assert line["message"] == "submit refused code=unknown_provider provider=nowhere " \
        "model=gpt-x", line
    assert (line["level"], line["outcome"], line["code"], line["identity"]) == \
        ("INFO", "refused", "unknown_provider", "local"), line
    assert "call_id" not in line, line


def test_every_line_of_a_call_names_its_identity_call_provider_and_model(
        daemon: DaemonProcess) -> None:
    call_id, done = _run(daemon, "emu", {"model": "gpt-emu#fields", "messages": HELLO})
    assert done["status"] == "completed", done
    records = _all_logged(daemon, call_id, 1)
    assert {r["process_name"] for r in records} >= {"MainProcess"} and \
        any(str(r["process_name"]).startswith("worker-") for r in records), records
    for record in records:
        assert (record["identity"], record["provider"], record["model"]) == \
            ("local", "emu", "gpt-emu#fields"), record
    last = next(r for r in records if r["message"].startswith("call completed"))
    assert (last["status"], last["finish_reason"], last["attempt"]) == \
        ("completed", "stop", 1), last
    ended = next(r for r in records if r["message"].startswith("attempt ended"))
    assert ended["finish_reason"] == "stop", ended


def _title(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().split(b"\0", 1)[0].decode()


def test_process_titles(daemon: DaemonProcess, emu: EmulatorClient) -> None:
    with daemon.client() as client:
        pids = client.status()["processes"]
        # Named for the daemon's endpoint: two daemons on one machine differ.
        name = daemon.endpoint.split("://", 1)[-1]
        assert _title(pids["supervisor"]) == f"streamfence[{name}]: supervisor"
        assert _title(pids["sink"]) == f"streamfence[{name}]: sink"
        assert _title(pids["zygote"]) == f"streamfence[{name}]: zygote"
        # A stream of ~1 s keeps its worker busy long enough to be seen.
        emu.script("slow", [{"chunks": 20, "chunk_delay_s": 0.05}])
        call_id = client.submit("emu", {"model": "gpt-emu#slow", "messages": HELLO})

        def busy_worker() -> dict[str, Any] | None:
            return next((w for w in client.status()["workers"] if w["call_id"] == call_id),
                        None)

        worker = wait_until(busy_worker, 10, "a worker running the call")
        assert worker is not None
        wid, pid = worker["worker_id"], worker["pid"]
        running = f"streamfence[{name}]: worker {wid} (call {call_id[:8]}…, attempt 1)"
        wait_until(lambda: _title(pid) == running, 5, f"the title {running!r}")
        assert list(client.events(call_id, timeout_s=30.0))[-1]["status"] == "completed"
        wait_until(lambda: _title(pid) == f"streamfence[{name}]: worker {wid} (idle)", 5,
                   "the worker's idle title")
        for w in client.status()["workers"]:
            if w["state"] == "idle":
                assert _title(w["pid"]) == f"streamfence[{name}]: worker {w['worker_id']} (idle)"


def test_every_process_of_the_tree_has_a_title(daemon: DaemonProcess) -> None:
    """No helper process hides in the tree (multiprocess's resource tracker
    was one: ~10 MiB of an idle daemon's footprint, and nothing used it)."""
    with daemon.client() as client:
        supervisor = client.status()["processes"]["supervisor"]
    name = daemon.endpoint.split("://", 1)[-1]
    tree = psutil.Process(supervisor).children(recursive=True)
    assert tree, "the supervisor has no children"
    untitled = {p.pid: _title(p.pid) for p in tree
                if not _title(p.pid).startswith(f"streamfence[{name}]: ")}
    assert not untitled, f"processes without a streamfence title: {untitled}"
