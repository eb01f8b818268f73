"""The `calls` request (docs/PROTOCOL.md "calls"), against a real daemon: the
calls newest first, filtered and paged; one call with its attempts; each
identity's own calls only, every call for an admin; bad fields refused,
counted, and the daemon serving on. And a journal of an earlier version
gets the columns the list reads."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from streamfence.devtools.emulator.control import EmulatorClient
from streamfence.protocol.client import Client, ClientError
from streamfence.protocol.keys import KeyStore
from streamfence.supervisor.journal import Journal
from streamfence.supervisor.journal_file import SCHEMA
from tests.harness import DaemonProcess
from tests.wires import DaemonFactory, request_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def daemon(module_daemon: DaemonFactory) -> DaemonProcess:
    return module_daemon(daemon={"backoff_base_s": 0.05, "backoff_max_s": 0.2})


def _client(daemon: DaemonProcess, name: str | None = None) -> Client:
    if name is None:
        return daemon.client()
    creds = KeyStore(daemon.state_dir / "keys").register(name, daemon.endpoint)
    return Client(daemon.endpoint, credentials=creds)


def _run(client: Client, key: str, session: str | None = None) -> str:
    call_id = client.submit("emu", request_for("openai", key), session_id=session)
    for _ in client.events(call_id):
        pass
    assert client.result(call_id, wait_s=10.0) is not None  # done at the supervisor too
    return call_id


def test_pages_newest_first_with_filters_and_a_cursor(daemon: DaemonProcess) -> None:
    with _client(daemon, "pager") as client:
        made = [_run(client, "page", session=f"pager-s{i}") for i in range(5)]
        first = client.calls(limit=2)
        assert [c["call_id"] for c in first["calls"]] == made[::-1][:2]
        seen, before = [], None
        while True:
            page = client.calls(limit=2, before=before)
            seen += [c["call_id"] for c in page["calls"]]
            before = page["next"]
            if before is None:
                break
        assert seen == made[::-1]  # every call once, newest first
        row = first["calls"][0]
        assert row["identity"] == "pager" and row["state"] == "completed"
        assert row["provider"] == "emu" and row["model"] == "emu-model#page"
        assert row["attempts"] == 1 and row["chars"] > 0 and row["first_chunk_ms"] is not None
        assert [c["call_id"] for c in client.calls(search="pager-s3")["calls"]] == [made[3]]
        assert [c["call_id"] for c in client.calls(search=made[1][:10])["calls"]] == [made[1]]
        assert len(client.calls(state="completed")["calls"]) == 5
        assert client.calls(state="live")["calls"] == []
        assert client.calls(state="failed")["calls"] == []
        assert client.calls(provider="other")["calls"] == []


def test_one_call_has_its_attempts_and_request(daemon: DaemonProcess,
                                               emu: EmulatorClient) -> None:
    emu.script("zombie", [{"fault": "stall", "after": 2, "stall_s": 3.0}])
    with daemon.client() as client:
        call_id = client.submit("emu", request_for("openai", "zombie"),
                                options={"stale_timeout_s": 1.0, "on_partial": "restart"})
        for _ in client.events(call_id):
            pass
        assert client.result(call_id, wait_s=10.0) is not None
        (call,) = client.calls(call_id=call_id)["calls"]
    first, second = call["attempt_rows"]
    assert (first["how"], second["how"]) == ("stale", "ended")
    assert first["worker_pid"] and second["worker_pid"] != first["worker_pid"]
    assert second["started"] >= first["ended"]
    assert call["request"] == request_for("openai", "zombie")
    assert call["options"]["on_partial"] == "restart"


def test_a_client_sees_its_own_calls_and_an_admin_every_call(daemon: DaemonProcess) -> None:
    with _client(daemon, "alice") as alice, _client(daemon, "bob") as bob, \
            daemon.client() as admin:
        mine = _run(alice, "alice")
        theirs = _run(bob, "bob")
        assert {c["identity"] for c in alice.calls(limit=500)["calls"]} == {"alice"}
        assert alice.calls(identity="bob")["calls"] == []
        assert alice.calls(call_id=theirs)["calls"] == []
        assert alice.calls(search=theirs)["calls"] == []
        everyone = {c["call_id"] for c in admin.calls(limit=500)["calls"]}
        assert {mine, theirs} <= everyone
        assert [c["call_id"] for c in admin.calls(identity="bob")["calls"]] == [theirs]


@pytest.mark.parametrize(("field", "value"), [
    ("state", "bogus"), ("limit", 0), ("limit", 501), ("before", "not-a-cursor"),
    ("search", 7), ("search", "x" * 300)])
def test_a_bad_field_is_refused_and_counted(daemon: DaemonProcess, field: str,
                                            value: Any) -> None:
    with daemon.client() as client:
        before = client.status()["counters"].get("bad_input.bad_message", 0)
        reply = client.request({"v": 1, "op": "calls", "ref": "r1", field: value})
        assert reply["op"] == "error" and reply["code"] == "bad_message", reply
        assert field in reply["message"]
        assert client.status()["counters"]["bad_input.bad_message"] == before + 1
        with pytest.raises(ClientError):
            client.calls(**{field: value})  # the client's own check, before sending
        assert client.calls(limit=1)["op"] == "calls_reply"


def test_a_journal_of_an_earlier_version_gets_the_new_columns(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    old = "\n".join(line for line in SCHEMA.splitlines()
                    if not line.lstrip().startswith(("model TEXT", "chars INTEGER")))
    db = sqlite3.connect(path)
    db.executescript(old)
    db.close()
    Journal(str(path)).close()
    db = sqlite3.connect(path)
    calls = {row[1] for row in db.execute("PRAGMA table_info(calls)")}
    attempts = {row[1] for row in db.execute("PRAGMA table_info(attempts)")}
    indexes = {row[1] for row in db.execute("PRAGMA index_list(calls)")}
    db.close()
    assert "model" in calls and "chars" in attempts
    assert {"calls_created", "calls_owner_created"} <= indexes
