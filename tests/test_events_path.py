"""The events path (docs/ARCHITECTURE.md §1): the sink sends each call's events
to its subscribers' listeners itself; the supervisor is not on the per-delta
path. Shown by freezing the supervisor (SIGSTOP) in the middle of a stream:
the deltas keep arriving. Also: the events socket answers only registered
keys, each listener receives only the calls it subscribed, and a client says
`listen` once."""

from __future__ import annotations

import os
import signal
import uuid
from dataclasses import replace
from typing import Any

import msgpack
import pytest
import zmq

from streamfence.devtools.emulator.control import EmulatorClient
from streamfence.protocol.credentials import load_credentials
from streamfence.protocol.messages import events_endpoint
from streamfence.sink.transcript import TranscriptReader
from tests.harness import DaemonProcess, is_listening, process_state
from tests.wires import DaemonFactory, request_for

pytestmark = pytest.mark.slow

CHUNKS = 60
GAP_S = 0.05  # the emulator's pace: 3 s for the stream
FROZEN_DELTAS = 10  # deltas that must arrive while the supervisor is stopped


@pytest.fixture(scope="module")
def daemon(module_daemon: DaemonFactory) -> DaemonProcess:
    return module_daemon(daemon={"workers_spare": 2})


def test_deltas_reach_the_subscriber_while_the_supervisor_is_frozen(
        daemon: DaemonProcess, emu: EmulatorClient) -> None:
    key = f"frozen-{uuid.uuid4().hex[:8]}"
    emu.script(key, [{"fault": "ok", "chunks": CHUNKS, "chunk_delay_s": GAP_S}])
    assert daemon.proc is not None
    supervisor = daemon.proc.pid
    with daemon.client(timeout_s=30.0) as client:
        call_id = client.submit("emu", request_for("openai", key))
        events = client.events(call_id, timeout_s=20.0)
        first = next(events)
        assert first["op"] == "delta", first
        os.kill(supervisor, signal.SIGSTOP)
        try:
            frozen: list[dict[str, Any]] = []
            while len(frozen) < FROZEN_DELTAS:  # each wait bounded by events()'s timeout
                frozen.append(next(events))
            assert all(e["op"] == "delta" for e in frozen), frozen
            assert process_state(supervisor) == "T", "the supervisor was not stopped all along"
        finally:
            os.kill(supervisor, signal.SIGCONT)
        rest = list(events)
    seqs = [e["seq"] for e in [first, *frozen, *rest]]
    assert seqs == list(range(1, len(seqs) + 1)), seqs
    done = rest[-1]
    assert done["op"] == "done" and done["status"] == "completed", done
    assert done["response"]["content"] == emu.log(key)[0]["text"]


def _dealer(ctx: zmq.Context[Any], daemon: DaemonProcess, routing_id: bytes,
            credentials: Any) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.setsockopt(zmq.ROUTING_ID, routing_id)
    if credentials is not None:
        credentials.apply(sock)
    sock.connect(events_endpoint(daemon.endpoint))
    return sock


def test_the_events_socket_hears_only_registered_keys(daemon: DaemonProcess) -> None:
    """A CURVE client with an unregistered key gets no answer to `listen`; the
    admin's key gets `listening`. (Same key store as the client endpoint.)"""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    good = load_credentials(daemon.credentials_path)
    stranger = replace(good, public_key=(pair := zmq.curve_keypair())[0], secret_key=pair[1])
    ok = _dealer(ctx, daemon, b"l-" + uuid.uuid4().hex.encode(), good)
    bad = _dealer(ctx, daemon, b"l-" + uuid.uuid4().hex.encode(), stranger)
    try:
        for sock in (ok, bad):
            sock.send(msgpack.packb({"v": 1, "op": "listen"}), zmq.NOBLOCK)
        assert ok.poll(10_000), "no answer to listen from a registered key"
        assert is_listening(msgpack.unpackb(ok.recv()))
        assert not bad.poll(1_000), "an unregistered key was answered on the events socket"
    finally:
        ok.close()
        bad.close()
    sink = _sink_stats(daemon)
    assert sink["events_auth_refused"] >= 1, sink


def test_a_subscriber_receives_only_the_calls_it_subscribed(
        daemon: DaemonProcess, emu: EmulatorClient) -> None:
    """Two clients stream at once; each listener gets its own call's events only."""
    keys = [f"own-{i}-{uuid.uuid4().hex[:6]}" for i in range(2)]
    for k in keys:
        emu.script(k, [{"fault": "ok", "chunks": 20, "chunk_delay_s": 0.01}])
    with daemon.client() as a, daemon.client() as b:
        calls = [a.submit("emu", request_for("openai", keys[0])),
                 b.submit("emu", request_for("openai", keys[1]))]
        got = [list(a.events(calls[0], timeout_s=20.0)), list(b.events(calls[1], timeout_s=20.0))]
        for client, other in ((a, calls[1]), (b, calls[0])):
            # Nothing of the other call was received (buffered or handed out).
            assert client._core.router.next_event(other) is None, "another client's events came"
        for events, call in zip(got, calls, strict=True):
            assert {e["call_id"] for e in events} == {call}
            assert events[-1]["op"] == "done"


def _sink_stats(daemon: DaemonProcess) -> dict[str, Any]:
    with daemon.client() as admin:
        sink: dict[str, Any] = admin.status()["sink"]
        return sink


def test_a_client_says_listen_once(daemon: DaemonProcess, emu: EmulatorClient) -> None:
    """Once per events connection (again only after a reconnect), not per request."""
    before = _sink_stats(daemon)["listens"]
    with daemon.client() as client:
        for _ in range(3):
            k = f"once-{uuid.uuid4().hex[:6]}"
            emu.script(k, [{"fault": "ok", "chunks": 3}])
            call_id = client.submit("emu", request_for("openai", k))
            assert list(client.events(call_id, timeout_s=20.0))[-1]["op"] == "done"
        connections = max(1, client._core.router.handshakes)
    assert _sink_stats(daemon)["listens"] - before == connections


BIG_ANSWER = 40 << 20  # bytes of text: well past the 16 MiB frame limit and the 1 MiB kept


def test_a_40_mb_answer_is_received_whole_and_stored(
        daemon: DaemonProcess, emu: EmulatorClient) -> None:
    """The done event stays small (`content_omitted`); the client assembles the
    answer from the deltas, which are the transcript's."""
    key = f"huge-{uuid.uuid4().hex[:8]}"
    piece = "".join(chr(ord("a") + i % 26) for i in range(4095)) + "\n"
    text = piece * (BIG_ANSWER // len(piece))
    emu.script(key, [{"fault": "ok", "chunks": len(text) // len(piece), "text": text}])
    with daemon.client(timeout_s=30.0) as client:
        done = client.run("emu", request_for("openai", key), timeout_s=60.0)
        call_id = done["call_id"]
        # The raw done event, as the daemon stores and sends it.
        stored = client.result(call_id)
    assert done["status"] == "completed", {k: done[k] for k in ("status", "error")}
    assert done["response"]["content"] == text, \
        f"the assembled answer has {len(done['response']['content'])} of {len(text)} bytes"
    assert stored is not None and stored["response"]["content_omitted"] is True
    assert stored["response"]["content"] == "" and len(msgpack.packb(stored)) < 4096
    reader = TranscriptReader(str(daemon.state_dir / "transcript.db"))
    try:
        deltas = [msgpack.unpackb(e) for e in reader.events_after(call_id, 0)]
    finally:
        reader.close()
    assert "".join(e["data"] for e in deltas if e["op"] == "delta") == text


def test_a_consumer_that_falls_a_window_behind_resumes_once_and_misses_nothing(
        daemon: DaemonProcess, emu: EmulatorClient) -> None:
    """The client reads nothing until the call has ended: the events socket cuts
    it off after a window; reading, it sees the cut_off, subscribes again once
    from its last seq, and the replay (paced by its acks) fills the rest."""
    key = f"lag-{uuid.uuid4().hex[:8]}"
    chunks = 2000  # 4 KiB each: 8 MiB, twice the window
    emu.script(key, [{"fault": "ok", "chunks": chunks, "text": "x" * 4095 * chunks}])
    cut_before = _sink_stats(daemon)["events_cut_offs"]
    with daemon.client(timeout_s=30.0) as client, daemon.client() as watcher:
        call_id = client.submit("emu", request_for("openai", key))
        assert watcher.result(call_id, wait_s=60.0) is not None, "the call did not end in 60 s"
        subscribes = client._core.subscribes
        events = list(client.events(call_id, timeout_s=30.0))
        resubscribed = client._core.subscribes - subscribes
    assert [e["seq"] for e in events] == list(range(1, chunks + 2))
    assert "".join(e["data"] for e in events[:-1]) == "x" * 4095 * chunks
    assert _sink_stats(daemon)["events_cut_offs"] - cut_before == 1
    assert resubscribed == 1, f"{resubscribed} subscribes after the cut_off (expected one)"
