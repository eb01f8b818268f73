"""Fair shares of the events socket per identity (issue 29, item 1;
docs/SECURITY.md, "Limits"; sink/shares.py).

Units: the caps on one identity's listeners and subscriptions (`Shares`).
Through the real daemon (real CURVE, real SQLite): one identity's listeners
that never read hold at most its share of the sink's buffer, and another
identity's fresh call streams to its listener meanwhile, with no cut-off;
subscribes past the caps are refused `too_many_subscriptions` and counted.
(How fast is for the scenario script: here the only bound is a generous
timeout.)"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from streamfence.devtools.emulator.control import EmulatorClient
from streamfence.protocol.client import Client
from streamfence.protocol.credentials import Credentials
from streamfence.protocol.internal.control import ListenerOwner
from streamfence.protocol.keys import KeyStore
from streamfence.protocol.messages import events_endpoint
from streamfence.sink.shares import PRUNE_FLOOR, Shares
from streamfence.sink.subscribers import BATCH_BYTES, IDENTITY_BYTES
from tests.harness import DaemonProcess, is_listening, wait_until
from tests.wires import DaemonFactory, request_for

MIB = 1 << 20

# ---- units: the caps ---------------------------------------------------------------


def test_caps_on_one_identitys_listeners_and_subscriptions() -> None:
    shares, following = Shares(), set[tuple[bytes, str]]()
    active = lambda listener, call: (listener, call) in following  # noqa: E731
    capped = ListenerOwner("capped", max_listeners=2, max_subscriptions=3)
    for listener, call in ((b"l1", "a"), (b"l2", "a"), (b"l1", "b")):
        assert shares.admit(listener, call, capped, active) is None
        following.add((listener, call))
    refused = shares.admit(b"l3", "a", capped, active)
    assert refused is not None and refused.startswith("too_many_subscriptions: ") \
        and "max_listeners 2" in refused, refused
    refused = shares.admit(b"l2", "b", capped, active)
    assert refused is not None and "max_subscriptions 3" in refused, refused
    assert shares.admit(b"l1", "a", capped, active) is None  # again: replaces, not added
    # Another identity has its own caps: capped's use none of its room.
    assert shares.admit(b"o1", "a", ListenerOwner("other", 1, 1), active) is None
    assert shares.stats()["events_refused.max_listeners"] == 1
    assert shares.stats()["events_refused.max_subscriptions"] == 1
    # Ended subscriptions free their room (pruned when a cap is reached).
    following.discard((b"l2", "a"))
    assert shares.admit(b"l3", "a", capped, active) is None
    assert shares.of[b"l3"].name == "capped" and b"l2" not in shares.of


def test_a_listener_stays_charged_to_its_first_identity_and_revocation_drops_it() -> None:
    shares = Shares()
    always = lambda listener, call: True  # noqa: E731
    assert shares.admit(b"l", "a", ListenerOwner("first"), always) is None
    assert shares.admit(b"l", "b", ListenerOwner("second"), always) is None
    assert shares.of[b"l"].name == "first"
    assert shares.drop(b"l") == {"a", "b"} and b"l" not in shares.of
    assert shares.drop(b"l") == set()


def test_records_of_ended_subscriptions_are_pruned_without_caps() -> None:
    shares = Shares()
    never = lambda listener, call: False  # noqa: E731
    for i in range(10 * PRUNE_FLOOR):
        assert shares.admit(f"l{i}".encode(), "c", ListenerOwner("open"), never) is None
    assert len(shares.of) <= PRUNE_FLOOR + 1  # pruned as they doubled


# ---- through the daemon --------------------------------------------------------------

ROGUES = 80  # one identity's listeners that never read: 80 windows are 320 MiB
CAPS = """
[identities.rogue]
max_listeners = 100

[identities.capped]
max_listeners = 2
max_subscriptions = 3
"""


@pytest.fixture(scope="module")
def daemon(module_daemon: DaemonFactory) -> DaemonProcess:
    return module_daemon({"emu": "openai"}, config_tail=CAPS)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _events_socket(ctx: zmq.Context[zmq.Socket[bytes]], daemon: DaemonProcess,
                   creds: Credentials) -> tuple[str, zmq.Socket[bytes]]:
    """A listener id and its events connection, its `listen` answered."""
    listener = f"l-{uuid.uuid4().hex}"
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.rcvhwm = 4  # a reader that never reads holds little here: the backlog is the sink's
    sock.setsockopt(zmq.ROUTING_ID, listener.encode())
    creds.apply(sock)
    sock.connect(events_endpoint(daemon.endpoint))
    sock.send(msgpack.packb({"v": 1, "op": "listen"}))
    assert sock.poll(10_000), "no answer to listen on the events socket"
    assert is_listening(msgpack.unpackb(sock.recv()))
    return listener, sock


def _req_socket(ctx: zmq.Context[zmq.Socket[bytes]], daemon: DaemonProcess,
                creds: Credentials) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    creds.apply(sock)
    sock.connect(daemon.endpoint)
    return sock


def _ask(sock: zmq.Socket[bytes], msg: dict[str, Any]) -> dict[str, Any]:
    sock.send(msgpack.packb(msg))
    assert sock.poll(10_000), f"no answer to {msg}"
    reply: dict[str, Any] = msgpack.unpackb(sock.recv())
    return reply


def _read_all(sock: zmq.Socket[bytes], read: int) -> tuple[list[dict[str, Any]], int]:
    """What waits on an events connection (batches flattened), acked."""
    got: list[dict[str, Any]] = []
    while True:
        try:
            frame = sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            break
        read += len(frame)
        msg = msgpack.unpackb(frame)
        got.extend(msg if isinstance(msg, list) else [msg])
    if got:
        sock.send(msgpack.packb({"v": 1, "op": "ack", "read": read}))
    return got, read


def _sink(daemon: DaemonProcess) -> dict[str, Any]:
    with daemon.client() as admin:
        sink: dict[str, Any] = admin.status()["sink"]
        return sink


def _settled_backlog(daemon: DaemonProcess) -> int:
    """The sink's unacknowledged bytes once the rogue's replays stopped
    growing them (they wait for acks that never come)."""
    last = -1

    def settled() -> int | None:
        nonlocal last
        now = int(_sink(daemon)["events_unacked_bytes"])
        done = now == last and now >= 16 * MIB
        last = now
        return now if done else None

    return wait_until(settled, 120, "the rogue listeners' backlog to settle", interval=1.0)


@pytest.mark.slow
def test_one_identitys_silent_listeners_leave_another_identitys_events_alone(
        daemon: DaemonProcess, emu: EmulatorClient, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    store = KeyStore(daemon.state_dir / "keys")
    rogue = store.register("rogue", daemon.endpoint)
    alice = store.register("alice", daemon.endpoint)
    big = f"big-{uuid.uuid4().hex[:8]}"
    emu.script(big, [{"fault": "ok", "chunks": 2000, "text": "s" * (8 * MIB)}])
    with Client(daemon.endpoint, 60.0, credentials=rogue) as c:
        call_id = c.run("emu", request_for("openai", big), timeout_s=120.0)["call_id"]
    rogue_req = _req_socket(ctx, daemon, rogue)
    silent = [_events_socket(ctx, daemon, rogue) for _ in range(ROGUES)]
    try:
        for listener, _ in silent:
            rogue_req.send(msgpack.packb({"v": 1, "op": "subscribe", "ref": listener,
                                          "call_id": call_id, "from_seq": 0,
                                          "listener": listener}))
        backlog = _settled_backlog(daemon)
        # Its share, passed by at most one frame per listener (a listener with
        # nothing outstanding always gets one).
        assert backlog <= IDENTITY_BYTES + ROGUES * BATCH_BYTES, backlog

        key = f"fresh-{uuid.uuid4().hex[:8]}"
        emu.script(key, [{"fault": "ok", "chunks": 8, "text": "a fresh answer"}])
        listener, events = _events_socket(ctx, daemon, alice)
        req = _req_socket(ctx, daemon, alice)
        try:
            accepted = _ask(req, {"v": 1, "op": "submit", "ref": "fresh", "listener": listener,
                                  "call": {"provider": "emu",
                                           "request": request_for("openai", key)}})
            assert accepted["op"] == "accepted", accepted
            got: list[dict[str, Any]] = []
            read = 0
            deadline = time.monotonic() + 60
            while not [m for m in got if m.get("op") == "done"]:
                assert time.monotonic() < deadline, f"alice's call got only {got}"
                events.poll(100)
                more, read = _read_all(events, read)
                got += more
            assert not [m for m in got if m.get("op") in ("cut_off", "error")], got
            assert [m["seq"] for m in got] == list(range(1, len(got) + 1)), got
            assert got[-1]["status"] == "completed", got[-1]
        finally:
            req.close()
            events.close()
    finally:
        rogue_req.close()
        for _, sock in silent:
            sock.close()


def _long_call(sock: zmq.Socket[bytes], emu: EmulatorClient) -> str:
    key = f"long-{uuid.uuid4().hex[:8]}"
    emu.script(key, [{"fault": "ok", "chunks": 3000, "chunk_delay_s": 0.01,
                      "text": "w " * 3000}])
    accepted = _ask(sock, {"v": 1, "op": "submit", "ref": key,
                           "call": {"provider": "emu", "request": request_for("openai", key)}})
    assert accepted["op"] == "accepted", accepted
    call_id: str = accepted["call_id"]
    return call_id


def _subscribe(req: zmq.Socket[bytes], listener: tuple[str, zmq.Socket[bytes]],
               call_id: str) -> dict[str, Any] | None:
    """Subscribe; None when the listener gets the call's events, else the error."""
    ref = uuid.uuid4().hex
    req.send(msgpack.packb({"v": 1, "op": "subscribe", "ref": ref, "call_id": call_id,
                            "listener": listener[0]}))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if req.poll(50):
            reply: dict[str, Any] = msgpack.unpackb(req.recv())
            assert reply.get("ref") == ref, reply
            return reply
        got, _ = _read_all(listener[1], 0)
        if [m for m in got if m.get("call_id") == call_id and m.get("op") == "delta"]:
            return None
    raise AssertionError(f"neither events nor an error for the subscribe to {call_id}")


@pytest.mark.slow
def test_subscribes_past_an_identitys_caps_are_refused_with_a_code(
        daemon: DaemonProcess, emu: EmulatorClient, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    capped = KeyStore(daemon.state_dir / "keys").register("capped", daemon.endpoint)
    req = _req_socket(ctx, daemon, capped)
    listeners = [_events_socket(ctx, daemon, capped) for _ in range(3)]
    before = _sink(daemon)
    try:
        first, second = _long_call(req, emu), _long_call(req, emu)
        assert _subscribe(req, listeners[0], first) is None
        assert _subscribe(req, listeners[1], first) is None
        refused = _subscribe(req, listeners[2], first)  # a third listener (max_listeners 2)
        assert refused is not None and refused["code"] == "too_many_subscriptions" \
            and "max_listeners 2" in refused["message"], refused
        assert _subscribe(req, listeners[0], second) is None
        refused = _subscribe(req, listeners[1], second)  # a fourth subscription (max 3)
        assert refused is not None and refused["code"] == "too_many_subscriptions" \
            and "max_subscriptions 3" in refused["message"], refused
        sink = _sink(daemon)
        assert sink["events_refused.max_listeners"] == before["events_refused.max_listeners"] + 1
        assert sink["events_refused.max_subscriptions"] == \
            before["events_refused.max_subscriptions"] + 1
        with daemon.client() as admin:
            assert admin.status()["counters"]["refused.too_many_subscriptions"] >= 2
        for call_id in (first, second):
            assert _ask(req, {"v": 1, "op": "cancel", "ref": "c", "call_id": call_id})
    finally:
        req.close()
        for _, sock in listeners:
            sock.close()


# ---- the events socket itself (in-process, real ZeroMQ) ---------------------------


def test_one_identitys_backlog_stops_at_its_share_and_leaves_the_others_room(
        tmp_path: Path) -> None:
    from streamfence.sink.subscribers import Subscribers

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    subs = Subscribers(ctx, f"ipc://{tmp_path}/events", None)
    socks = []
    try:
        def connect(name: str) -> bytes:
            sock = ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.setsockopt(zmq.ROUTING_ID, name.encode())
            sock.connect(f"ipc://{tmp_path}/events")
            sock.send(msgpack.packb({"v": 1, "op": "listen"}))
            socks.append(sock)

            def listening() -> bool:
                subs.drain()
                return bool(sock.poll(10))

            wait_until(listening, 10, f"{name}'s listen to be answered")
            sock.recv()
            return name.encode()

        always = lambda listener, call: True  # noqa: E731
        rogues = [connect(f"rogue-{i:02d}-listener") for i in range(12)]
        for listener in rogues:
            assert subs.subscribe(listener, "c", ListenerOwner("rogue"), always) is None
        alice = connect("alice-listener-0001")
        assert subs.subscribe(alice, "a", ListenerOwner("alice"), always) is None
        event = b"\xa1x" * (MIB // 2)  # a 1 MiB "event"
        cuts = subs.deliver([(set(rogues), [event])] * 4)  # 4 MiB to each: 48 MiB wanted
        # The rogue's listeners hold its share, passed by at most one frame each.
        held = subs.outstanding
        assert IDENTITY_BYTES - MIB < held <= IDENTITY_BYTES + len(rogues) * MIB, held
        cut = {listener for listener, _ in cuts}
        assert cut and cut <= set(rogues), cut  # those past the share: cut off
        # Alice's listener is not behind the rogue's backlog: a whole window
        # fits (but for the `listening` reply it has not acked).
        assert subs.room(alice) >= 4 * MIB - 64
        assert subs.deliver([({alice}, [event])] * 3) == []
    finally:
        for sock in socks:
            sock.close()
        subs.close()
        ctx.term()
