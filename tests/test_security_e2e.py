"""Security through the real daemon (docs/SECURITY.md): CURVE + ZAP on the
client socket with real keys and the real `streamfence keys` CLI, request
admission per wire, call ownership byte for byte, identity limits, and the
state directory's privacy.

One daemon serves the module (every test uses its own identities and script
keys, so they do not interfere); the emulator records what reached the
"provider"."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
import zmq.auth

from streamfence.devtools.emulator.control import EmulatorClient
from streamfence.devtools.emulator.state import messages_digest
from streamfence.protocol.client import Client, ClientError
from streamfence.protocol.credentials import Credentials, load_credentials
from streamfence.protocol.keys import KeyStore
from streamfence.protocol.messages import events_endpoint
from streamfence.supervisor.journal import FILE_BYTES
from tests.harness import DaemonProcess, is_listening, wait_until
from tests.wires import WIRES, DaemonFactory, request_for

pytestmark = pytest.mark.slow

NO_REPLY_S = 3.0  # "no reply within a few seconds"
IDENTITIES = """
[identities.alice]
role = "client"

[identities.lim]
providers = ["openai"]
max_in_flight = 1

[identities.lim_rate]
submits_per_s = 1

[identities.lim_cap]
max_tokens = 100

[identities.lim_cap_large]
max_tokens = 100
"""


@pytest.fixture(scope="module")
def daemon(module_daemon: DaemonFactory) -> DaemonProcess:
    return module_daemon({wire: wire for wire in WIRES}, config_tail=IDENTITIES)


@pytest.fixture(scope="module")
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _register(daemon: DaemonProcess, name: str) -> Credentials:
    """A registered identity (as `streamfence keys new` does, in-process)."""
    return KeyStore(daemon.state_dir / "keys").register(name, daemon.endpoint)


def _cli(daemon: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "streamfence.cli", *args,
                           "--config", str(daemon.config_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"streamfence {' '.join(args)}: {proc.stderr}"
    return proc


def _sock(ctx: zmq.Context[zmq.Socket[bytes]], daemon: DaemonProcess,
          creds: Credentials) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    creds.apply(sock)
    sock.connect(daemon.endpoint)
    return sock


LISTENER = "mallory-listener-0001"


def _listening(ctx: zmq.Context[zmq.Socket[bytes]], daemon: DaemonProcess,
               creds: Credentials) -> zmq.Socket[bytes]:
    """An events connection under LISTENER, its `listen` answered."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.setsockopt(zmq.ROUTING_ID, LISTENER.encode())
    creds.apply(sock)
    sock.connect(events_endpoint(daemon.endpoint))
    sock.send(_pack({"v": 1, "op": "listen"}))
    assert sock.poll(10_000), "no answer to listen on the events socket"
    assert is_listening(msgpack.unpackb(sock.recv()))
    return sock


def _pack(msg: dict[str, Any]) -> bytes:
    packed: bytes = msgpack.packb(msg, use_bin_type=True)
    return packed


def _recv(sock: zmq.Socket[bytes], timeout_s: float = 10.0) -> bytes | None:
    """The next frame, or None when none comes within `timeout_s`."""
    if not sock.poll(int(timeout_s * 1000)):
        return None
    return sock.recv()


def _ask(sock: zmq.Socket[bytes], msg: dict[str, Any], timeout_s: float = 10.0) -> bytes | None:
    sock.send(_pack(msg))
    return _recv(sock, timeout_s)


def _ops(call_id: str, ref: str = "r") -> list[dict[str, Any]]:
    """One message of each request op."""
    return [{"v": 1, "op": "status", "ref": f"{ref}-status"},
            {"v": 1, "op": "submit", "ref": f"{ref}-submit",
             "call": {"provider": "openai", "request": request_for("openai", "never")}},
            {"v": 1, "op": "subscribe", "ref": f"{ref}-subscribe", "call_id": call_id},
            {"v": 1, "op": "result", "ref": f"{ref}-result", "call_id": call_id},
            {"v": 1, "op": "cancel", "ref": f"{ref}-cancel", "call_id": call_id}]


def _journaled(daemon: DaemonProcess, owner: str) -> list[dict[str, Any]]:
    """The requests of `owner`'s calls in the journal (what was accepted)."""
    return [msgpack.unpackb(row[0], raw=False) for row in
            daemon.journal_rows("SELECT q.request FROM requests q JOIN calls USING (call_id) "
                                       "WHERE owner = ?", owner)]


def _model_keys(requests: list[dict[str, Any]]) -> list[str]:
    return sorted(str(r.get("model") or r.get("modelId")).partition("#")[2] for r in requests)


def _counters(daemon: DaemonProcess) -> dict[str, int]:
    with daemon.client() as admin:
        counters: dict[str, int] = admin.status()["counters"]
        return counters


def _assert_silent(*socks: tuple[zmq.Socket[bytes], str]) -> None:
    """Every op sent on each (socket, what) gets no reply within NO_REPLY_S (all
    sockets at once, to keep the wait short). Sends never block: once ZAP has
    refused a handshake the DEALER has no connection left to queue on, and a
    message it cannot even send is not heard either."""
    poller = zmq.Poller()
    for sock, _ in socks:
        for msg in _ops(uuid.uuid4().hex):
            try:
                sock.send(_pack(msg), zmq.NOBLOCK)
            except zmq.Again:
                break
        poller.register(sock, zmq.POLLIN)
    deadline = time.monotonic() + NO_REPLY_S
    while (left := deadline - time.monotonic()) > 0:
        ready = dict(poller.poll(int(left * 1000) + 1))
        for sock, what in socks:
            if sock in ready:
                raise AssertionError(f"{what} got a reply: "
                                     f"{msgpack.unpackb(sock.recv(), raw=False)}")


def _assert_answered(sock: zmq.Socket[bytes], what: str) -> dict[str, Any]:
    frame = _ask(sock, {"v": 1, "op": "status", "ref": "alive"})
    assert frame is not None, f"{what}: no reply to status"
    reply: dict[str, Any] = msgpack.unpackb(frame, raw=False)
    assert reply["op"] == "status_reply" and reply["ref"] == "alive", reply
    return reply


# ---- 1. CURVE ----------------------------------------------------------------------


def test_unregistered_key_gets_no_reply_and_is_counted(
        daemon: DaemonProcess, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    server_public, _ = zmq.auth.load_certificate(str(daemon.state_dir / "keys" / "server.key"))
    public, secret = zmq.curve_keypair()
    stranger = Credentials("stranger", daemon.endpoint, server_public, public, secret)
    before = _counters(daemon).get("auth_refused", 0)
    sock = _sock(ctx, daemon, stranger)
    try:
        _assert_silent((sock, "an unregistered key"))
    finally:
        sock.close()
    wait_until(lambda: _counters(daemon).get("auth_refused", 0) > before, 10,
               "the daemon to count the refused handshake under auth_refused")
    # The daemon answered the admin meanwhile: the silence was the refusal.
    admin = daemon.socket(ctx)
    try:
        _assert_answered(admin, "the admin")
    finally:
        admin.close()


def test_cli_registered_key_works_forged_and_revoked_do_not(
        daemon: DaemonProcess, ctx: zmq.Context[zmq.Socket[bytes]],
        emu: EmulatorClient) -> None:
    out = _cli(daemon, "keys", "new", "bob")
    path = daemon.state_dir / "keys" / "bob.credentials"
    assert str(path) in out.stdout
    bob = load_credentials(path)
    assert "bob" in _cli(daemon, "keys", "list").stdout.split()
    with Client(credentials=path, timeout_s=10.0) as client:  # its endpoint is the daemon's
        status = client.status()
        assert status["identity"] == "bob" and status["role"] == "client", status
        done = client.run("openai", request_for("openai", "bob-ok"), timeout_s=30.0)
        assert done["status"] == "completed", done
    # bob's public key with a secret key that is not bob's: the handshake fails,
    # while bob's own key is heard.
    _, other_secret = zmq.curve_keypair()
    forged = _sock(ctx, daemon, Credentials("bob", bob.endpoint, bob.server_key,
                                            bob.public_key, other_secret))
    connected = _sock(ctx, daemon, bob)  # made, and heard, before the revocation
    fresh = None
    try:
        _assert_answered(connected, "bob before the revocation")
        _assert_silent((forged, "bob's public key with another secret key"))
        unauthenticated = _counters(daemon).get("refused.unauthenticated", 0)
        refused = _counters(daemon).get("auth_refused", 0)
        _cli(daemon, "keys", "revoke", "bob")
        assert not path.exists()
        assert "bob" not in _cli(daemon, "keys", "list").stdout.split()
        fresh = _sock(ctx, daemon, bob)
        _assert_silent((connected, "an open connection of a revoked key"),
                       (fresh, "a new connection of a revoked key"))
        wait_until(lambda: _counters(daemon).get("refused.unauthenticated", 0)
                   >= unauthenticated + len(_ops("x")), 10,
                   "the daemon to count the revoked key's messages (refused.unauthenticated)")
        wait_until(lambda: _counters(daemon).get("auth_refused", 0) > refused, 10,
                   "the daemon to refuse the revoked key's handshake (auth_refused)")
    finally:
        for sock in (forged, connected, fresh):
            if sock is not None:
                sock.close()


def test_rotate_makes_old_credentials_fail_and_new_work(
        daemon: DaemonProcess, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    _cli(daemon, "keys", "new", "carol")
    path = daemon.state_dir / "keys" / "carol.credentials"
    old = load_credentials(path)
    connected = _sock(ctx, daemon, old)
    fresh_old = fresh_new = None
    try:
        assert _assert_answered(connected, "carol's first key")["identity"] == "carol"
        _cli(daemon, "keys", "rotate", "carol")
        new = load_credentials(path)
        assert new.public_key != old.public_key and new.secret_key != old.secret_key
        fresh_old = _sock(ctx, daemon, old)
        fresh_new = _sock(ctx, daemon, new)
        assert _assert_answered(fresh_new, "carol's new key")["identity"] == "carol"
        _assert_silent((connected, "an open connection of carol's rotated-out key"),
                       (fresh_old, "a new connection with carol's old key"))
    finally:
        for sock in (connected, fresh_old, fresh_new):
            if sock is not None:
                sock.close()


def test_revoke_stays_inside_the_allow_list(daemon: DaemonProcess,
                                            ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    keys = daemon.state_dir / "keys"
    before = {p: p.read_bytes() for p in keys.glob("server.key*")}
    proc = subprocess.run([sys.executable, "-m", "streamfence.cli", "keys", "revoke",
                           "../server", "--config", str(daemon.config_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "no identity '../server'" in proc.stderr, proc.stderr
    assert {p: p.read_bytes() for p in keys.glob("server.key*")} == before
    admin = daemon.socket(ctx)
    try:
        _assert_answered(admin, "the admin after a refused revoke")
    finally:
        admin.close()


def test_allow_list_change_within_one_mtime_tick_is_seen(tmp_path: Path) -> None:
    """A revocation whose directory mtime equals the one of the last read (a
    coarse timestamp clock) still takes effect (KeyStore.identity_of)."""
    store = KeyStore(tmp_path / "keys")
    dave = store.register("dave", "ipc:///nowhere")
    now = time.time_ns()
    os.utime(store.clients_dir, ns=(now, now))
    assert store.identity_of(dave.public_key) == "dave"  # read in the tick of a change
    store.revoke("dave")
    os.utime(store.clients_dir, ns=(now, now))  # ... and the clock has not ticked since
    assert store.identity_of(dave.public_key) is None


# ---- 2. request admission per wire ------------------------------------------------

TRANSPORT_FIELDS = {"extra_headers": {"X-Injected": "1"}, "extra_query": {"q": "1"},
                    "extra_body": {"injected": True}, "timeout": 0.5}


@pytest.mark.parametrize("wire", WIRES)
def test_sdk_transport_options_are_refused_before_the_provider(
        daemon: DaemonProcess, emu: EmulatorClient, wire: str) -> None:
    key = f"transport-{wire}"
    with daemon.client() as client:
        for field, value in TRANSPORT_FIELDS.items():
            request = dict(request_for(wire, key), **{field: value})
            with pytest.raises(ClientError) as info:
                client.submit(wire, request)
            assert info.value.code == "bad_message", (field, info.value)
            assert f"'call.request.{field}'" in info.value.message, info.value.message
        # The same request without the field reaches the provider under the same
        # key: so an empty record above means nothing of those calls got there.
        done = client.run(wire, request_for(wire, key), timeout_s=30.0)
        assert done["status"] == "completed", done
    records = emu.log(key)
    assert len(records) == 1, records
    assert not set(TRANSPORT_FIELDS) & set(records[0]["request"]), records[0]["request"]
    assert _model_keys(_journaled(daemon, "local")).count(key) == 1  # nothing else journaled


# ---- 3. ownership -----------------------------------------------------------------


def _error(frame: bytes | None) -> dict[str, Any]:
    assert frame is not None, "no reply"
    reply: dict[str, Any] = msgpack.unpackb(frame, raw=False)
    return reply


def _same_as_unknown(sock: zmq.Socket[bytes], op: str, call_id: str) -> None:
    """`op` on `call_id` answers exactly the bytes an unknown id of the same length
    gets (with the id substituted: the message names it), and nothing else comes."""
    unknown = uuid.uuid4().hex
    assert len(unknown) == len(call_id)
    extra: dict[str, Any] = {"wait_s": 0.0} if op == "result" else \
        {"listener": LISTENER} if op == "subscribe" else {}
    want = _ask(sock, {"v": 1, "op": op, "ref": "same-ref", "call_id": unknown, **extra})
    got = _ask(sock, {"v": 1, "op": op, "ref": "same-ref", "call_id": call_id, **extra})
    assert want is not None and _error(want)["code"] == "unknown_call", _error(want)
    assert got is not None, f"{op} of another identity's call: no reply"
    assert got.replace(call_id.encode(), unknown.encode()) == want, (
        op, msgpack.unpackb(got, raw=False), msgpack.unpackb(want, raw=False))
    # Nothing else was sent on this socket for the call.
    reply = _error(_ask(sock, {"v": 1, "op": "status", "ref": f"after-{op}"}))
    assert reply["op"] == "status_reply" and reply["ref"] == f"after-{op}", reply


def test_another_identitys_call_is_invisible(daemon: DaemonProcess, emu: EmulatorClient,
                                             ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    alice = _register(daemon, "alice")
    mallory = _register(daemon, "mallory")
    emu.script("own-slow", [{"fault": "stall", "after": 1, "stall_s": 60.0}])
    with Client(credentials=alice, timeout_s=10.0) as a, daemon.client() as admin:
        finished = a.submit("openai", request_for("openai", "own-done"),
                            idempotency_key="turn-1")
        a_events = list(a.events(finished, timeout_s=30.0))
        a_done = a_events[-1]
        assert a_done["status"] == "completed", a_done
        assert a.submit("openai", request_for("openai", "own-done"),
                        idempotency_key="turn-1", subscribe=False) == finished  # dedupes
        running = a.submit("openai", request_for("openai", "own-slow"),
                           options={"stale_timeout_s": 120.0}, subscribe=False)

        def admin_sees() -> dict[str, Any] | None:
            rows = admin.status()["calls"]["running"]
            return next((r for r in rows if r["call_id"] == running
                         and r["state"] == "running"), None)

        row = wait_until(admin_sees, 20, "the admin to see alice's call running")
        assert row is not None and row["owner"] == "alice", row
        emu.wait_for(lambda rs: rs and rs[0]["chunks_sent"] >= 1, 10, "the first chunk",
                     key="own-slow")

        sock = _sock(ctx, daemon, mallory)
        events = _listening(ctx, daemon, mallory)
        try:
            for call_id in (finished, running):
                for op in ("subscribe", "result", "cancel"):
                    _same_as_unknown(sock, op, call_id)
            # Nor on mallory's events connection (no replay, no live event).
            assert _recv(events, 0.5) is None, "an event of alice's call reached mallory"
            status = _error(_ask(sock, {"v": 1, "op": "status", "ref": "st"}))
            assert status["identity"] == "mallory" and status["role"] == "client", status
            assert not {"workers", "processes", "pool", "counters", "sink",
                        "breakers"} & set(status), sorted(status)
            assert status["calls"]["active"] == 0 and status["calls"]["running"] == [], status
            assert finished.encode() not in _pack(status) and running.encode() not in _pack(status)

            # mallory's cancel changed nothing: the call still runs, for its owner too.
            assert admin_sees() is not None
            assert a.result(running) is None

            # The same idempotency key under another identity is another call.
            sock.send(_pack({"v": 1, "op": "submit", "ref": "idem", "listener": LISTENER, "call": {
                "provider": "openai", "request": request_for("openai", "own-done"),
                "idempotency_key": "turn-1"}}))
            reply = _recv(sock, 30)
            assert reply is not None, "no reply to mallory's submit"
            frames: list[dict[str, Any]] = [msgpack.unpackb(reply, raw=False)]
            deadline = time.monotonic() + 30
            while frames[-1].get("op") != "done":
                assert time.monotonic() < deadline, f"no done for mallory's call: {frames}"
                frame = _recv(events, 30)
                assert frame is not None, f"mallory's call went silent: {frames}"
                got = msgpack.unpackb(frame, raw=False)
                frames.extend(got if isinstance(got, list) else [got])  # a batch, or one
        finally:
            sock.close()
            events.close()
        accepted = next(f for f in frames if f["op"] == "accepted")
        assert accepted["call_id"] != finished and accepted["duplicate"] is False, accepted
        assert {f["call_id"] for f in frames} == {accepted["call_id"]}, frames
        m_done = frames[-1]
        assert m_done["status"] == "completed", m_done
        assert m_done["response"]["content"] != a_done["response"]["content"]
        assert len(emu.log("own-done")) == 2  # alice's call and mallory's: two requests

        cancelled = a.cancel(running)
        assert cancelled["op"] == "cancelling", cancelled
        done = a.result(running, wait_s=20.0)
        assert done is not None and done["status"] == "cancelled", done


# ---- 4. limits ----------------------------------------------------------------------


def _refusal(client: Client, provider: str, request: dict[str, Any]) -> ClientError:
    with pytest.raises(ClientError) as info:
        client.submit(provider, request, subscribe=False)
    return info.value


def test_providers_and_max_in_flight(daemon: DaemonProcess, emu: EmulatorClient) -> None:
    lim = _register(daemon, "lim")
    emu.script("lim-slow", [{"fault": "stall", "after": 1, "stall_s": 60.0}])
    with Client(credentials=lim, timeout_s=10.0) as client:
        for other in ("anthropic", "bedrock"):
            exc = _refusal(client, other, request_for(other, "lim-never"))
            assert exc.code == "unknown_provider", exc
            assert "configured: openai)" in exc.message, exc.message  # the others are hidden
        first = client.submit("openai", request_for("openai", "lim-slow"),
                              options={"stale_timeout_s": 120.0}, subscribe=False)
        exc = _refusal(client, "openai", request_for("openai", "lim-second"))
        assert exc.code == "too_many_calls" and "max_in_flight" in exc.message, exc
        client.cancel(first)
        done = client.result(first, wait_s=20.0)
        assert done is not None and done["status"] == "cancelled", done
        done = client.run("openai", request_for("openai", "lim-after"), timeout_s=30.0)
        assert done["status"] == "completed", done
    assert emu.log("lim-never") == [] and emu.log("lim-second") == []
    # Refused before anything was journaled: only the two accepted calls are.
    assert _model_keys(_journaled(daemon, "lim")) == ["lim-after", "lim-slow"]


def test_submit_rate(daemon: DaemonProcess) -> None:
    creds = _register(daemon, "lim_rate")
    with Client(credentials=creds, timeout_s=10.0) as client:
        client.submit("openai", request_for("openai", "rate"), subscribe=False)
        exc = _refusal(client, "openai", request_for("openai", "rate"))
        assert exc.code == "rate_limited", exc
        assert "1 calls per second" in exc.message, exc.message

        def admitted() -> bool:
            try:
                client.submit("openai", request_for("openai", "rate"), subscribe=False)
            except ClientError as err:
                assert err.code == "rate_limited", err
                return False
            return True

        wait_until(admitted, 5, "the submit rate to admit another call", interval=0.2)


def test_max_tokens_cap(daemon: DaemonProcess, emu: EmulatorClient) -> None:
    creds = _register(daemon, "lim_cap")
    with Client(credentials=creds, timeout_s=10.0) as client:
        over = [("openai", dict(request_for("openai", "cap-over"), max_tokens=101)),
                ("openai", dict(request_for("openai", "cap-over"), max_completion_tokens=500)),
                ("anthropic", request_for("anthropic", "cap-over")),  # max_tokens 1024
                ("bedrock", dict(request_for("bedrock", "cap-over"),
                                 inferenceConfig={"maxTokens": 4096}))]
        for wire, request in over:
            exc = _refusal(client, wire, request)
            assert exc.code == "limit_exceeded", (wire, exc)
            assert "at most 100" in exc.message, exc.message
        for wire in WIRES:
            request = request_for(wire, f"cap-{wire}")
            if wire == "anthropic":
                request["max_tokens"] = 100  # required on this wire: at the cap is fine
            done = client.run(wire, request, timeout_s=30.0)
            assert done["status"] == "completed", (wire, done)
    assert emu.log("cap-over") == []
    assert _model_keys(_journaled(daemon, "lim_cap")) == sorted(f"cap-{w}" for w in WIRES)
    sent = {wire: emu.log(f"cap-{wire}")[0]["request"] for wire in WIRES}
    assert sent["openai"]["max_completion_tokens"] == 100, sent["openai"]
    assert "max_tokens" not in sent["openai"], sent["openai"]
    assert sent["anthropic"]["max_tokens"] == 100, sent["anthropic"]
    assert sent["bedrock"]["inferenceConfig"]["maxTokens"] == 100, sent["bedrock"]


def test_max_tokens_cap_holds_for_a_large_request(daemon: DaemonProcess,
                                                  emu: EmulatorClient) -> None:
    """A large request is journaled as its submit frame (never encoded again):
    the cap filled in on admission still reaches the provider, and the
    messages arrive as sent."""
    creds = _register(daemon, "lim_cap_large")
    request = request_for("openai", "cap-large", "z" * FILE_BYTES)
    with Client(credentials=creds, timeout_s=10.0) as client:
        done = client.run("openai", request, timeout_s=30.0)
    assert done["status"] == "completed", done
    [sent] = emu.log("cap-large")
    assert sent["request"]["max_completion_tokens"] == 100, sent["request"]
    assert sent["request"]["messages_sha256"] == messages_digest(request["messages"])


# ---- 5. private state ---------------------------------------------------------------


def test_state_dir_is_private_after_a_call(daemon: DaemonProcess) -> None:
    with daemon.client() as client:
        done = client.run("openai", request_for("openai", "private"), timeout_s=30.0)
        assert done["status"] == "completed", done
    root = daemon.state_dir
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    # The launcher's own files (its config and the daemon's captured stdout) are
    # written by the test process, not the daemon.
    harness = {daemon.config_path, daemon.log_path}
    seen: dict[str, int] = {}
    for path in root.rglob("*"):
        if path in harness:
            continue
        mode = path.lstat().st_mode
        seen[str(path.relative_to(root))] = mode
        assert stat.S_IMODE(mode) & 0o077 == 0, f"{path} is {stat.S_IMODE(mode):o}"
    for expected in ("journal.db", "journal.db-wal", "transcript.db", "transcript.db-wal",
                     "daemon.lock", "keys", "keys/server.key", "keys/server.key_secret",
                     "keys/local.credentials", "keys/clients/local.key", "run"):
        assert expected in seen, f"{expected} not in the state dir: {sorted(seen)}"
    assert any(name.startswith("run/") and stat.S_ISSOCK(mode) for name, mode in seen.items()), \
        f"no ipc socket under run/: {sorted(seen)}"


def test_state_dir_readable_by_others_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, 0o755)
    config = tmp_path / "streamfence.toml"
    config.write_text(f'[daemon]\nstate_dir = "{state}"\n'
                      f'endpoint = "ipc://{tmp_path}/front"\n')
    proc = subprocess.run([sys.executable, "-m", "streamfence.cli", "serve", "--config",
                           str(config)], capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"chmod 700 {state}" in lines[0] and "755" in lines[0], lines[0]
    assert sorted(p.name for p in state.iterdir()) == []  # nothing written there
