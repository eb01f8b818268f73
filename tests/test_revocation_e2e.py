"""Revocation and rotation reach the events socket (issue 29, item 5;
docs/SECURITY.md, "Rotating and revoking"), through the real daemon, real
CURVE and the real `streamfence keys` CLI.

bob follows a long call of his on a raw events connection (reading and
acking, as a good client does) while alice follows hers. Then `streamfence
keys revoke bob` (or `rotate bob`) runs. What "at once" means here, precisely:
the sink looks at the allow-list when inotify says `keys/clients/` changed
(sink/key_checks.py; every second besides), so what it sent bob before it
saw the change is in flight and may still arrive; then
bob's connection gets one `error` with code `key_revoked`, and after that
nothing at all, while alice's listener goes on receiving her call. The test
asserts: the notice comes within a generous `NOTICE_S` of the CLI's answer,
fewer than `IN_FLIGHT_MAX` events of bob's call arrive between that answer
and the notice (the call streams about 200 a second, so that is well under
a second's worth, not "the rest of the call"), and none after it while alice
gets at least `ALICE_AFTER` more."""

from __future__ import annotations

import select
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

from streamfence.devtools.emulator.control import EmulatorClient
from streamfence.protocol.credentials import Credentials
from streamfence.protocol.keys import KeyStore
from streamfence.protocol.messages import events_endpoint
from tests.harness import DaemonProcess, is_listening, wait_until
from tests.wires import DaemonFactory, request_for

pytestmark = pytest.mark.slow

CHUNKS = 6000  # bob's and alice's calls: about 30 s each ...
CHUNK_DELAY_S = 0.005  # ... at about 200 events a second
NOTICE_S = 5.0  # the key_revoked notice comes within this of the CLI's answer
IN_FLIGHT_MAX = 200  # events of bob's call between the CLI's answer and the notice, at most
QUIET_S = 2.0  # then nothing more for bob, for this long ...
ALICE_AFTER = 20  # ... while alice gets at least this many more events


@pytest.fixture(scope="module")
def daemon(module_daemon: DaemonFactory) -> DaemonProcess:
    return module_daemon({"emu": "openai"})


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


class Follower:
    """One identity's raw client: a request socket, and an events connection
    that reads and acks everything (so flow control never cuts it off)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], daemon: DaemonProcess,
                 creds: Credentials) -> None:
        self.listener = f"l-{uuid.uuid4().hex}"
        self.req = ctx.socket(zmq.DEALER)
        self.events = ctx.socket(zmq.DEALER)
        self.events.setsockopt(zmq.ROUTING_ID, self.listener.encode())
        for sock, where in ((self.req, daemon.endpoint),
                            (self.events, events_endpoint(daemon.endpoint))):
            sock.linger = 0
            creds.apply(sock)
            sock.connect(where)
        self.read = 0  # bytes read since `listen` (what `ack` reports)
        self.events.send(msgpack.packb({"v": 1, "op": "listen"}))
        assert self.events.poll(10_000), "no answer to listen on the events socket"
        assert is_listening(msgpack.unpackb(self.events.recv()))

    def submit(self, key: str) -> str:
        self.req.send(msgpack.packb({"v": 1, "op": "submit", "ref": "s", "listener": self.listener,
                                     "call": {"provider": "emu",
                                              "request": request_for("openai", key)}}))
        assert self.req.poll(10_000), "no answer to submit"
        reply = msgpack.unpackb(self.req.recv())
        assert reply["op"] == "accepted", reply
        call_id: str = reply["call_id"]
        return call_id

    def pump(self, seconds: float) -> list[dict[str, Any]]:
        """Every message that arrives within `seconds` (batches flattened), acked."""
        got: list[dict[str, Any]] = []
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if not self.events.poll(int(left * 1000) + 1):
                break
            while True:
                try:
                    frame = self.events.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.read += len(frame)
                msg = msgpack.unpackb(frame)
                got.extend(msg if isinstance(msg, list) else [msg])
            self.events.send(msgpack.packb({"v": 1, "op": "ack", "read": self.read}))
        return got

    def close(self) -> None:
        self.req.close()
        self.events.close()


def _long_call(emu: EmulatorClient) -> str:
    key = f"long-{uuid.uuid4().hex[:8]}"
    emu.script(key, [{"fault": "ok", "chunks": CHUNKS, "chunk_delay_s": CHUNK_DELAY_S,
                      "text": "w " * CHUNKS}])
    return key


def _cli(daemon: DaemonProcess, *args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "streamfence.cli", *args,
                           "--config", str(daemon.config_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"streamfence {' '.join(args)}: {proc.stderr}"


def _deltas(msgs: list[dict[str, Any]]) -> int:
    return sum(1 for m in msgs if m.get("op") == "delta")


@pytest.mark.parametrize("change", ["revoke", "rotate"])
def test_a_revoked_or_rotated_key_stops_its_events_at_once(
        daemon: DaemonProcess, emu: EmulatorClient, ctx: zmq.Context[zmq.Socket[bytes]],
        change: str) -> None:
    store = KeyStore(daemon.state_dir / "keys")
    bob_name, alice_name = f"bob-{change}", f"alice-{change}"
    bob = Follower(ctx, daemon, store.register(bob_name, daemon.endpoint))
    alice = Follower(ctx, daemon, store.register(alice_name, daemon.endpoint))
    try:
        bob.submit(_long_call(emu))
        alice.submit(_long_call(emu))
        seen: list[dict[str, Any]] = []

        def streaming() -> bool:
            seen.extend(bob.pump(0.2))
            return _deltas(seen) >= 20

        wait_until(streaming, 30, "bob's call to stream")
        assert not [m for m in seen if m.get("op") in ("error", "cut_off", "done")], seen
        alice.pump(0.1)

        _cli(daemon, "keys", change, bob_name)
        answered = time.monotonic()

        # In flight: what the sink sent bob before it saw the change, then the notice.
        in_flight: list[dict[str, Any]] = []
        notice = None
        while notice is None and time.monotonic() - answered < NOTICE_S:
            for msg in bob.pump(0.1):
                if msg.get("op") == "error":
                    notice = msg
                elif notice is None:
                    in_flight.append(msg)
                else:
                    raise AssertionError(f"bob got {msg} after the notice {notice}")
            alice.pump(0.01)
        assert notice is not None, (
            f"no key_revoked notice within {NOTICE_S} s of `keys {change}`; bob got "
            f"{_deltas(in_flight)} more deltas meanwhile")
        assert notice["code"] == "key_revoked" and notice["ref"] is None, notice
        assert _deltas(in_flight) < IN_FLIGHT_MAX, (
            f"bob got {_deltas(in_flight)} deltas between `keys {change}` and the notice")
        assert not [m for m in in_flight if m.get("op") != "delta"], in_flight

        # After the notice: nothing for bob, while alice's call goes on.
        after_bob: list[dict[str, Any]] = []
        after_alice: list[dict[str, Any]] = []
        deadline = time.monotonic() + QUIET_S
        while time.monotonic() < deadline or _deltas(after_alice) < ALICE_AFTER:
            assert time.monotonic() < deadline + 30, "alice's call stopped streaming"
            after_bob += bob.pump(0.05)
            after_alice += alice.pump(0.05)
        assert after_bob == [], f"bob got {len(after_bob)} messages after the notice"
        assert not [m for m in after_alice if m.get("op") in ("error", "cut_off")], after_alice

        with daemon.client() as admin:
            sink = admin.status()["sink"]
        assert sink["events_key_revoked"] >= 1, sink
    finally:
        bob.close()
        alice.close()


def test_the_events_socket_cuts_a_connection_whose_key_left_the_allow_list(
        tmp_path: Path) -> None:
    """The mechanism alone, in-process with real CURVE and a real inotify
    watch: the revoke turns the watch's descriptor readable, `tick` is due at
    once and finds the revoked key's connection, tells it, and returns it for
    its subscriptions to be dropped; the other identity's connection is
    untouched. Between changes the loop's timer is the slow recheck, not a
    10 Hz poll (each look is a wake-up of the sink)."""
    from streamfence.protocol.internal.control import ListenerOwner
    from streamfence.sink.key_checks import RECHECK_S
    from streamfence.sink.subscribers import Subscribers
    from tests.fakes import Clock

    store = KeyStore(tmp_path / "keys")
    endpoint = f"ipc://{tmp_path}/events"
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    clock = Clock()
    subs = Subscribers(ctx, endpoint, store, clock)
    socks: list[zmq.Socket[bytes]] = []
    try:
        def answered(sock: zmq.Socket[bytes]) -> bool:
            subs.drain()
            return bool(sock.poll(10))

        def listening(name: str) -> zmq.Socket[bytes]:
            sock = ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.setsockopt(zmq.ROUTING_ID, f"{name}-listener-0001".encode())
            store.register(name, endpoint).apply(sock)
            sock.connect(endpoint)
            sock.send(msgpack.packb({"v": 1, "op": "listen"}))
            socks.append(sock)
            wait_until(lambda: answered(sock), 10, f"{name}'s listen to be answered")
            assert is_listening(msgpack.unpackb(sock.recv()))
            return sock

        bob, alice = listening("bob"), listening("alice")
        always = lambda listener, call: True  # noqa: E731
        for name in ("bob", "alice"):
            assert subs.subscribe(f"{name}-listener-0001".encode(), f"{name}-call",
                                  ListenerOwner(name), always) is None
        checks = subs.key_checks
        assert checks is not None
        keys_fd = checks.fileno()
        assert keys_fd is not None, "no inotify watch on keys/clients/"

        def keys_changed() -> bool:
            return bool(select.select([keys_fd], [], [], 0.05)[0])

        clock.now += RECHECK_S
        assert subs.tick() == []  # nothing changed
        assert subs.due >= clock.now + RECHECK_S, "the allow-list is polled, not watched"
        store.revoke("bob")
        wait_until(keys_changed, 10, "the watch on keys/clients/ to report the revoke")
        subs.keys_changed()
        assert subs.due <= clock.now, "tick is not due after keys/clients/ changed"
        assert subs.tick() == [b"bob-listener-0001"]
        assert bob.poll(5000), "bob was not told"
        notice = msgpack.unpackb(bob.recv())
        assert notice["op"] == "error" and notice["code"] == "key_revoked", notice
        assert subs.stats()["events_key_revoked"] == 1
        refused = subs.subscribe(b"bob-listener-0001", "bob-call", ListenerOwner("bob"), always)
        assert refused is not None and refused.startswith("key_revoked: "), refused
        # A `listen` on it again gets the same answer; alice's goes on as before.
        bob.send(msgpack.packb({"v": 1, "op": "listen"}))
        wait_until(lambda: answered(bob), 10, "an answer to bob's listen")
        assert msgpack.unpackb(bob.recv())["code"] == "key_revoked"
        clock.now += RECHECK_S
        assert subs.tick() == []
        assert subs.deliver([({b"alice-listener-0001"}, [msgpack.packb({"seq": 1})])]) == []
        assert alice.poll(5000) and msgpack.unpackb(alice.recv()) == {"seq": 1}
    finally:
        for sock in socks:
            sock.close()
        subs.close()
        ctx.term()
